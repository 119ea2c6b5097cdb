"""Which prefill worker a prompt goes to (KV-aware routing): the policy alone, on numbers the caller gathered.

Each candidate (a live prefill or mixed worker of the model, not draining) comes with the prompt's leading
tokens it holds in its prefix cache and the prompt tokens queued on it. The cost of sending the prompt to a
worker is the tokens it would compute before this prompt's first token: its queue plus the prompt's uncached
part. The cheapest wins, when it holds some of the prompt and is not overloaded; ties go to the least loaded.
When no worker holds any of it, the shared queue takes the job (workers pull when they have room: the best
balance when the cache cannot help) — unless the request names a `prompt_cache_key`: requests with one key
go to one worker (rendezvous hashing over the usable workers), so that the first of them warms the cache the
next ones hit; the key also wins ties for the longest prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class How(StrEnum):
    """Why a job went where it went (the routing metric's label)."""

    PREFIX = "prefix"  # to the worker holding (a long enough part of) its prefix
    AFFINITY = "affinity"  # to its prompt_cache_key's worker
    SHARED = "shared"  # to the shared queue: nothing cached anywhere that helps, or every worker overloaded


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    cached_tokens: int  # the prompt's leading tokens it holds (whole blocks, at most the prompt less one token)
    queued_tokens: int  # prompt tokens waiting on it (its heartbeat, plus what this gateway routed not yet taken)
    running: int = 0
    overloaded: bool = False  # queued past the gateway's bound: nothing is routed to it for its cache


@dataclass(frozen=True)
class Route:
    worker_id: str | None  # None: the shared queue
    how: How
    hit_tokens: int = 0  # cached tokens the chosen worker is expected to reuse


SHARED = Route(None, How.SHARED)


def choose(prompt_tokens: int, candidates: Sequence[Candidate], cache_key: str | None = None) -> Route:
    usable = [c for c in candidates if not c.overloaded]
    if not usable:
        return SHARED
    longest = max(c.cached_tokens for c in usable)
    if cache_key is not None:
        home = affinity_worker(cache_key, usable)
        if home.cached_tokens == longest:  # nobody holds more than the key's own worker
            how = How.PREFIX if longest else How.AFFINITY
            return Route(home.worker_id, how, home.cached_tokens)
    if longest == 0:
        return SHARED
    best = min(usable, key=lambda c: (_cost(prompt_tokens, c), c.queued_tokens, c.running, c.worker_id))
    if best.cached_tokens == 0:  # a worker with nothing cached is cheapest: let the shared queue balance
        return SHARED
    return Route(best.worker_id, How.PREFIX, best.cached_tokens)


def _cost(prompt_tokens: int, c: Candidate) -> int:
    """Tokens the worker computes before this prompt's first token: its queue, then the uncached part."""
    return c.queued_tokens + prompt_tokens - c.cached_tokens


def affinity_worker(cache_key: str, candidates: Sequence[Candidate]) -> Candidate:
    """The key's worker by rendezvous hashing: the highest hash of (key, worker). A worker leaving moves only its
    own keys; one joining takes about its share."""
    return max(candidates, key=lambda c: _rendezvous(cache_key, c.worker_id))


def _rendezvous(key: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{key}\x1f{worker_id}".encode(), digest_size=8).digest()
