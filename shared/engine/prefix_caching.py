"""Prefix caching, the requests' side: a request admitted from the queue takes the blocks of its longest cached
prefix instead of computing them, and a request's full blocks, once computed, are offered to the cache.

Names: block i of a request is named by the chained hash of its tokens up to (i + 1)·B (shared/prefix_hash.py),
rooted in the model as served (`namespace`) and the request's `cache_salt`: two requests share a block only if
everything before it is the same, for the same model and salt.

A hit of H tokens (whole blocks) is usable when every KV cache group (kv_groups.py) holds what the request's
next query reads: a full-attention group every block below H; a group of window W the blocks overlapping
[H - W + 1, H) (its blocks behind that window are FREED in the request's table, as the scheduler would have freed
them). A hit never covers the last token (it must run through the model for a next token to be sampled), nor
prompt positions whose logprobs are asked for and not yet collected (prompt_scoring.py reads their logits).

The scheduler calls `take_hit` when it admits a waiting request (empty tables, nothing computed) and `offer`
after every step; the block managers' `PrefixCache`s keep the names and the evictable blocks (prefix_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.engine.block_manager import FREED, BlockManager
from shared.engine.prefix_cache import PrefixCache, PrefixCacheEvents
from shared.engine.request import GroupTable, Request
from shared.prefix_hash import block_hash, root_hash

Group = tuple[BlockManager, int | None]  # a KV cache group's block manager and window (Scheduler.groups)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix caching so far (Engine.prefix_cache_stats). Tokens count requests' prompts at their first admission."""

    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, found cached (not computed)
    cached_blocks: int = 0  # KV cache group 0's cached blocks now, referenced or evictable
    evictions: int = 0  # group 0's cached blocks evicted so far

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCaching:
    def __init__(self, namespace: str, block_size: int, routed: PrefixCache) -> None:
        """`namespace`: the model as served (the gateway hashes prompts with the same); `routed`: group 0's cache,
        whose hashes and events the router sees."""
        self.namespace, self.block_size = namespace, block_size
        self.routed = routed
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ---- admission ------------------------------------------------------------------------------------

    def take_hit(self, req: Request, groups: Sequence[Group], tables: Sequence[GroupTable]) -> int:
        """Fill `req`'s empty tables with the blocks of its longest usable cached prefix (module doc), one more
        reference each; → the hit's tokens (a multiple of the block size; 0: a miss, tables untouched). The
        caller sets num_computed_tokens, and gives the blocks back (Scheduler.release) if it does not admit."""
        block_size = self.block_size
        limit = req.num_tokens - 1
        if req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_token_ids) - 1:
            limit = min(limit, len(req.prompt_logprobs))  # logprobs of positions 1..limit are collected
        m = self._longest(req, groups, limit // block_size)
        if m == 0:
            return 0
        for (blocks, window), table in zip(groups, tables, strict=True):
            assert blocks.cache is not None and not table.blocks
            lo = _first_needed(m * block_size, window, block_size)
            ids = [blocks.cache.block_of(h) for h in req.block_hashes[lo:m]]
            taken = [b for b in ids if b is not None]
            assert len(taken) == len(ids)  # _longest found every one
            blocks.take_cached(taken)
            table.blocks, table.freed = [FREED] * lo + taken, lo
        return m * block_size

    def admitted(self, req: Request, hit: int) -> None:
        """Count `req`'s first admission with a hit of `hit` tokens, and record it on the request."""
        req.num_cached_tokens = min(hit, len(req.prompt_token_ids))
        self.queried_tokens += len(req.prompt_token_ids)
        self.hit_tokens += req.num_cached_tokens

    def _longest(self, req: Request, groups: Sequence[Group], most: int) -> int:
        """The most blocks (≤ `most`) of `req`'s prefix every group holds what it needs of (module doc)."""
        if most <= 0:
            return 0
        hashes = self.hashes(req, most)
        m = most
        for blocks, window in groups:
            if window is None:  # every block below the hit: the run up to the first miss
                cache = blocks.cache
                assert cache is not None
                m = next((i for i in range(m) if cache.block_of(hashes[i]) is None), m)
        windowed = [(blocks.cache, w) for blocks, w in groups if w is not None]
        while m > 0:
            misses = [
                i
                for cache, w in windowed
                for i in range(_first_needed(m * self.block_size, w, self.block_size), m)
                if cache is not None and cache.block_of(hashes[i]) is None
            ]
            if not misses:
                return m
            m = max(misses)  # a hit past a missing block needs it (it is in its window); one of `m` blocks not
        return 0

    # ---- after a step ---------------------------------------------------------------------------------

    def offer(self, req: Request, groups: Sequence[Group], tables: Sequence[GroupTable]) -> None:
        """Name `req`'s full blocks computed since the last offer in every group that still holds them."""
        n = req.num_computed_tokens // self.block_size
        if n <= req.blocks_offered:
            return
        hashes = self.hashes(req, n)
        for (blocks, _), table in zip(groups, tables, strict=True):
            for i in range(req.blocks_offered, n):
                if table.blocks[i] != FREED:
                    blocks.cache_block(table.blocks[i], hashes[i])
        req.blocks_offered = n

    def hashes(self, req: Request, n: int) -> list[int]:
        """`req`'s block hashes, at least its first `n` (computed once: Request.block_hashes)."""
        have, block_size = req.block_hashes, self.block_size
        parent = have[-1] if have else root_hash(self.namespace, req.cache_salt)
        for i in range(len(have), n):
            parent = block_hash(parent, req.token_slice(i * block_size, (i + 1) * block_size))
            have.append(parent)
        return have

    # ---- what the router sees -------------------------------------------------------------------------

    def events(self) -> PrefixCacheEvents:
        assert self.routed.events is not None
        return self.routed.events.take()

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queried_tokens, self.hit_tokens, self.routed.num_cached, self.routed.evictions)


def _first_needed(hit: int, window: int | None, block_size: int) -> int:
    """The first block a group of `window` (None: full attention) needs for a query at position `hit`."""
    return 0 if window is None else max(0, hit - window + 1) // block_size
