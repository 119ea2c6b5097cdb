"""Prompt logprobs (echo, log-likelihood scoring): the logits at every prompt position a step computes, across
chunked prefill, scored against the next prompt token.

A request asking for them (params.prompt_logprobs) collects one TokenLogprobs per prompt position 1..P-1 in
`Request.prompt_logprobs`, in order; a recomputation (preemption, or a request continued from another engine)
computes positions already collected again and skips them. The logits of a whole chunk are (T, V): they are taken
`_ROWS` positions at a time so a long prompt never holds a (prompt length × vocabulary) tensor at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.engine.logprobs import prompt_logprobs
from shared.engine.scheduler import ScheduledSeq
from shared.model.transformer import CausalLM

_ROWS = 256


def score_prompts(model: CausalLM, hidden: torch.Tensor, seqs: Sequence[ScheduledSeq], ends: list[int]) -> None:
    """hidden (T_total, H): the step's flat hidden states; ends[i] = the end of seqs[i]'s rows in it."""
    for seq, end in zip(seqs, ends, strict=True):
        req = seq.request
        k = req.params.prompt_logprobs
        if k is None:
            continue
        start = req.num_computed_tokens  # the chunk's first position
        # target t (a prompt position) is scored by the row at position t - 1; positions 1..len(collected) are done
        first = max(start + 1, len(req.prompt_logprobs) + 1)
        last = min(start + seq.num_tokens, len(req.prompt_token_ids) - 1)
        for lo in range(first, last + 1, _ROWS):
            hi = min(lo + _ROWS, last + 1)
            rows = end - seq.num_tokens + (lo - 1 - start)
            logits = model.logits(hidden[rows : rows + (hi - lo)])
            req.prompt_logprobs += prompt_logprobs(logits, req.prompt_token_ids[lo:hi], k)
