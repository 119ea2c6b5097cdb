"""Which decode worker a prefilled request goes to (decode-side reuse): the policy alone, on numbers the caller
gathered.

A decode worker keeps the blocks of the requests it decoded in its prefix cache, so the next turn of a
conversation (the previous prompt, its answer, a new message) finds most of its prompt there: only the rest of
the KV is pulled. Each candidate (a live decode worker of the model, not draining) comes with the prompt's
leading tokens its cache holds and its room. The one holding the most wins, among those with room for the rest
of the prompt (ties: the fewest running, then the name, so one gateway's choice is stable); when none holds any,
or none with some has room, the shared decode queue takes the job: decode workers pull it when they have room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
