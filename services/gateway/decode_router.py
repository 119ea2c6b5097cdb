"""Which decode worker a prefilled request goes to (decode-side reuse): the policy alone, on numbers the caller
gathered.

A decode worker keeps the blocks of the requests it decoded in its prefix cache, so the next turn of a
conversation (the previous prompt, its answer, a new message) finds most of its prompt there: only the rest of
the KV is pulled. Each candidate (a live decode worker of the model, not draining) comes with the prompt's
leading tokens its cache holds and its room. The one holding the most wins, among those with room for the rest
of the prompt (ties: the fewest running, then the name, so one gateway's choice is stable); when none holds any,
or none with some has room, the shared decode queue takes the job: decode workers pull it when they have room.

Expert affinity (the gateway's expert_affinity_routing, off by default): KV reuse comes first, since what it saves
is certain (the pulled bytes); only when no worker holds any of the prompt does affinity decide, among the decode
workers with room for the whole prompt that published hot experts: they travel on the prefill job
(`affinity`), and the prefill worker, which alone learns which experts the prompt activated, hands the decode job
to the best match (shared/expert_affinity.py), or to the shared queue when none overlaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.messages import AffinityCandidate, DecodeAffinity, Heartbeat


@dataclass(frozen=True)
class DecodeCandidate:
    worker_id: str
    cached_tokens: int  # the prompt's leading tokens its cache holds (whole blocks, at most the prompt less one)
    free_tokens: int  # what its heartbeat's free KV blocks hold (evictable cached blocks count as free)
    running: int = 0


def choose_decode(prompt_tokens: int, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate | None:
    """The decode worker to route to, or None: the shared queue (module doc)."""
    usable = [c for c in candidates if c.cached_tokens > 0 and c.free_tokens >= prompt_tokens - c.cached_tokens]
    if not usable:
        return None
    return min(usable, key=lambda c: (-c.cached_tokens, c.running, c.worker_id))


def affinity(prompt_tokens: int, beats: Sequence[Heartbeat], top_k: int) -> DecodeAffinity | None:
    """The decode workers (live, not draining: `beats`) the prefill worker may pick among by expert affinity: those
    with room for the whole prompt and a published hot-expert summary, in the gateway's order; None when fewer than
    two (no choice to make: the shared queue serves as well)."""
    candidates = [
        AffinityCandidate(b.worker_id, b.running, b.hot_experts)
        for b in beats
        if b.hot_experts is not None and b.fit_blocks * b.block_size >= prompt_tokens
    ]
    return DecodeAffinity(top_k, candidates) if len(candidates) >= 2 else None
