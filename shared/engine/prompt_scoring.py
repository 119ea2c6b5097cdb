"""Prompt logprobs (echo, log-likelihood scoring): the logits at every prompt position a step computes, across
chunked prefill, scored against the next prompt token.

A request asking for them (params.prompt_logprobs) collects one TokenLogprobs per prompt position 1..P-1 in
`Request.prompt_logprobs`, in order; a recomputation (preemption, or a request continued from another engine)
computes positions already collected again and skips them. The logits of a whole chunk are (T, V): they are taken
`_ROWS` positions at a time so a long prompt never holds a (prompt length × vocabulary) tensor at once.

Planned before the step (`plan_scoring`: which rows of the step's hidden states, in which logits calls) so that
every rank of a worker group makes the same logits calls (shared/engine/step_inputs.py); scored after each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.logprobs import prompt_logprobs
from shared.engine.request import Request
from shared.engine.scheduler import ScheduledSeq

_ROWS = 256


@dataclass(frozen=True)
class ScoreSlice:
    request: Request
    first_row: int  # in the step's flat hidden states
    targets: list[int]  # the prompt tokens these rows' logits are scored against, in order


def plan_scoring(seqs: Sequence[ScheduledSeq], ends: list[int]) -> list[ScoreSlice]:
    """The scoring logits calls of a step; ends[i] = the end of seqs[i]'s rows in the flat hidden states."""
    slices = []
    for seq, end in zip(seqs, ends, strict=True):
        req = seq.request
        if req.params.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens  # the chunk's first position
        # target t (a prompt position) is scored by the row at position t - 1; positions 1..len(collected) are done
        first = max(start + 1, len(req.prompt_logprobs) + 1)
        last = min(start + seq.num_tokens, len(req.prompt_token_ids) - 1)
        for lo in range(first, last + 1, _ROWS):
            hi = min(lo + _ROWS, last + 1)
            slices.append(ScoreSlice(req, end - seq.num_tokens + (lo - 1 - start), req.prompt_token_ids[lo:hi]))
    return slices


def score(slice_: ScoreSlice, logits: torch.Tensor) -> None:
    """Collect one slice's logprobs: logits (len(targets), V), from the slice's rows."""
    k = slice_.request.params.prompt_logprobs
    assert k is not None
    slice_.request.prompt_logprobs += prompt_logprobs(logits, slice_.targets, k)
