"""Forking n choices inside a live engine (the mechanics: fork.py).

Two ways in: `add_group`'s fresh choices wait in `pending` until their parent samples its first token
(`at_first_token`, called by the step loop), and `fork` forks choices that already have tokens (a decode worker,
after importing the prompt's KV). Like `KvHandoff`, `Forker` works on the engine's state it is handed (its live
requests, scheduler, pools, grammar matchers, sampler) on the engine's thread.
"""

from __future__ import annotations

import torch

from shared.engine.fork import Choice, PendingForks, fork_children
from shared.engine.kv_cache import KvCache
from shared.engine.kv_handoff import KvHandoff
from shared.engine.outputs import RequestOutput, request_output
from shared.engine.request import PromptLimits, Request
from shared.engine.sampling import Sampler
from shared.engine.scheduler import Scheduler
from shared.engine.structured import StructuredDecoding


class Forker:
    def __init__(
        self,
        kv: KvCache,
        scheduler: Scheduler,
        requests: dict[str, Request],
        structured: StructuredDecoding,
        sampler: Sampler,
        handoff: KvHandoff,
        limits: PromptLimits,
    ) -> None:
        self.kv, self.scheduler, self.requests = kv, scheduler, requests
        self.structured, self.sampler, self.handoff, self.limits = structured, sampler, handoff, limits
        self.pending = PendingForks()  # children forked at their parent's first token

    def fork(self, parent_id: str, children: list[Choice]) -> list[RequestOutput]:
        """Fork choices that have sampled tokens (elsewhere: a decode worker after importing the prompt's KV)
        from a request whose KV covers its prompt: they share its full prompt blocks and copy the partial one.
        Returns an output for each child its tokens already ended. Raises KeyError for an unknown parent,
        ValueError for a parent without its prompt's KV or a child without tokens (nothing forked then)."""
        parent = self.requests[parent_id]
        for c in children:
            self.limits.check(self.requests, c.request_id, parent.prompt_token_ids + list(c.output_token_ids))
        made = fork_children(self.scheduler, self.kv.pools, parent, children, hold_kv=parent.hold_kv)
        self._register(made)
        return [request_output(r, r.output_token_ids[-1:], None) for r in made if r.is_finished]

    def at_first_token(self, parent: Request, logits: torch.Tensor) -> list[RequestOutput]:
        """The parent (in `pending`) just sampled its first token from `logits` (V,): sample each child's from the
        same row, fork them, and give the parent's blocks back if it only held them for the fork. The
        children's first outputs."""
        pending = self.pending.pop(parent.request_id)
        assert pending is not None  # the step loop calls this for a parent in `pending` only
        if not pending.children:  # every child was aborted meanwhile
            self._settle(parent, pending.parent_holds_kv)
            return []
        params = [c.params for c in pending.children]
        rows = logits.unsqueeze(0).expand(len(params), -1)
        history = (parent.prompt_token_ids, [])  # penalties count the prompt and nothing generated yet
        tokens, logprobs = self.sampler.sample_with_logprobs(rows, params, [0] * len(params), [history] * len(params))
        children = [Choice(c.request_id, c.params, (t,)) for c, t in zip(pending.children, tokens, strict=True)]
        first_logprobs = {c.request_id: lp for c, lp in zip(pending.children, logprobs, strict=True)}
        made = fork_children(self.scheduler, self.kv.pools, parent, children, hold_kv=pending.parent_holds_kv)
        self._settle(parent, pending.parent_holds_kv)
        self._register(made)
        outputs = []
        for r in made:
            r.prompt_logprobs = list(parent.prompt_logprobs)  # the same prompt: echo's logprobs for every choice
            lp = first_logprobs.get(r.request_id)
            outputs.append(request_output(r, r.output_token_ids, None if lp is None else [lp]))
        return outputs

    def _settle(self, parent: Request, holds_kv: bool) -> None:
        """The parent holds its KV only if its caller asked; a finished one that does not gives its blocks back."""
        parent.hold_kv = holds_kv
        if parent.is_finished and not parent.hold_kv:
            self.handoff.release(parent.request_id)

    def _register(self, made: list[Request]) -> None:
        """Put forked children in the engine: the live ones (each with its own grammar matcher when constrained,
        replaying its tokens), and finished ones that hold (no block: their release_kv only forgets them)."""
        for req in made:
            if not req.is_finished:
                self.structured.add(req.request_id, req.params.structured, req.output_token_ids)
            if not req.is_finished or req.hold_kv:
                self.requests[req.request_id] = req
