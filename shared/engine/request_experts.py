"""Per-request expert counts of the prompts that ask (decode routed by expert affinity, shared/expert_affinity.py):
the engine's side of shared/model/expert_trace.py.

`want(id)` before a request's first step; each step that computes prompt tokens of a wanted request arms the trace
over the step's tokens (runner.py), and its counts go to that request's (L, E) total; `take(id)` gives layer →
tokens per expert (and forgets it). Only the prompt's computed tokens count: a cached prefix was not computed here,
and decode steps are not traced. The router runs replicated on every rank of a worker group, so the leader's
model (the one the runner calls) counts the whole step: followers never arm."""

from __future__ import annotations

import torch

from shared.engine.scheduler import ScheduledSeq
from shared.model.expert_trace import ExpertTrace
from shared.model.transformer import CausalLM


class RequestExperts:
    def __init__(self, model: CausalLM) -> None:
        sparse = model.sparse_layers()
        self.trace: ExpertTrace | None = None
        if sparse:
            # one trace per model: engines built over the same weights (tests, benchmarks) share it (each arms and
            # takes it within its own step, on one thread); a second engine must not detach the first's
            first = next(iter(sparse.values()))
            self.trace = first.trace or ExpertTrace(sorted(sparse), first.expert_load.shape[0])
            for layer, moe in sparse.items():
                moe.trace, moe.trace_layer = self.trace, layer
        self._counts: dict[str, torch.Tensor] = {}  # wanted request → (L, E) int64 on the host
        self._rows: list[str] = []  # the armed step's rows

    def want(self, request_id: str) -> None:
        """Count `request_id`'s prompt from its next step (no-op on a model without routed experts)."""
        if self.trace is not None:
            shape = (len(self.trace.layers), self.trace.num_experts)
            self._counts.setdefault(request_id, torch.zeros(shape, dtype=torch.int64))

    @property
    def active(self) -> bool:
        """Whether a request's prompt is being counted (the engine steps in lockstep then: overlap.py)."""
        return bool(self._counts)

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def take(self, request_id: str) -> dict[int, list[int]]:
        """Layer → tokens of the request's prompt routed to each expert (empty if not wanted); forgets it."""
        counts = self._counts.pop(request_id, None)
        if counts is None or self.trace is None:
            return {}
        return dict(zip(self.trace.layers, counts.tolist(), strict=True))

    def before(self, seqs: list[ScheduledSeq], device: torch.device) -> None:
        """Arm the trace when the step computes prompt tokens of a wanted request."""
        if self.trace is None or not self._counts:
            return
        rows = [
            s.request.request_id
            for s in seqs
            if s.request.request_id in self._counts and s.request.num_computed_tokens < len(s.request.prompt_token_ids)
        ]
        if not rows:
            return
        row_of = {rid: i for i, rid in enumerate(rows)}
        owner: list[int] = []
        for s in seqs:  # tokens of untraced sequences (and a traced one's past its prompt) go to the dropped row
            req = s.request
            row = row_of.get(req.request_id, len(rows))
            prompt_left = max(0, len(req.prompt_token_ids) - req.num_computed_tokens)
            owner += [row] * min(s.num_tokens, prompt_left) + [len(rows)] * max(0, s.num_tokens - prompt_left)
        self.trace.arm(owner, len(rows), device)
        self._rows = rows

    def after(self) -> None:
        """Add the armed step's counts to its requests'."""
        if self.trace is None or not self.trace.armed:
            return
        counts = self.trace.take()
        for i, rid in enumerate(self._rows):
            if rid in self._counts:
                self._counts[rid] += counts[i]
        self._rows = []
