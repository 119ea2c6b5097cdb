"""Logical KV blocks: who holds which block, with reference counts.

Invariant (checked by `check_integrity`): every block is either free with count 0, used with count > 0, or
(prefix caching on) cached and evictable with count 0, and free + used + evictable == total. Reference counts let
two owners share a block, e.g. a request and a pending KV export that pins it until the pull completes, or two
requests with one prompt prefix.

Prefix caching (prefix_cache.py): a block named by its prefix hash outlives its last reference as an evictable
block; `num_free` and `can_allocate` count those as available, and `allocate` evicts the least recently used
ones when the free blocks run out. A referenced block is never evicted.

A block table entry FREED stands for a block given back while its request goes on: the tokens it held are
behind every layer's sliding window (Scheduler frees them), so no step reads them again. Table positions keep
their meaning (entry i holds positions i*B..), and `free`/`incref` pass over FREED entries.
"""

from __future__ import annotations

import numpy as np

from shared.engine.prefix_cache import PrefixCache

FREED = -1  # a block table entry whose block was freed behind the sliding window (see the module docstring)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; the caller should wait or preempt."""


class BlockManager:
    """Free blocks are a mask over the pool (True: free), so that an allocation can pick where its blocks
    lie: a request whose blocks are consecutive ids is sent from the pool in few long messages (one per
    layer, plane and run; shared/kv/transfer/pool_kv.py), where scattered blocks cost a gather or a message
    per short run. `allocate` therefore prefers, in order: extending the caller's run (`after`), the
    smallest free run that holds all `n` blocks, and else the longest runs first (fewest runs)."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None) -> None:
        """`cache`: this pool's prefix cache (None: prefix caching off, a block is free at its last reference)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = np.ones(num_blocks, dtype=bool)  # (num_blocks,): True where the block is free
        self._num_free = num_blocks  # of the mask; evictable cached blocks are not in it
        self._refs = [0] * num_blocks
        self.cache = cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: the free ones and the evictable cached ones."""
        return self._num_free + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (referenced), 0.0–1.0: evictable cached blocks count as free."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int, after: int | None = None) -> bool:
        """Whether `allocate(n, after)` would succeed (`after` matters where a pool is partitioned: dp_blocks.py)."""
        return n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` free blocks (count 1 each), as few runs of consecutive ids as the free blocks allow;
        `after`: the caller's last block, whose successors are taken if all `n` are free (a request growing
        keeps one run). Evicts the least recently used cached blocks first if the free ones are too few. All or
        nothing: raises NoFreeBlocksError and takes (and evicts) none."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        if n <= 0:
            return []
        while self._num_free < n:
            assert self.cache is not None  # num_free counted evictable blocks
            b = self.cache.evict()
            self._free[b] = True
            self._num_free += 1
        if (
            after is not None
            and after >= 0
            and after + n < self.num_blocks
            and self._free[after + 1 : after + 1 + n].all()
        ):
            blocks = list(range(after + 1, after + 1 + n))
        else:
            blocks = self._from_runs(n)
        self._free[blocks] = False
        self._num_free -= n
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free_runs(self) -> list[tuple[int, int]]:
        """The free blocks as maximal runs (first id, count), in id order."""
        starts, counts = self._runs()
        return list(zip(starts.tolist(), counts.tolist(), strict=True))

    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        return starts, np.flatnonzero(edges == -1) - starts

    def _from_runs(self, n: int) -> list[int]:
        """`n` free ids: the smallest run holding them all (best fit keeps long runs for long prompts), else
        the longest runs first, ascending within each."""
        starts, counts = self._runs()
        fits = np.flatnonzero(counts >= n)
        if fits.size:
            best = fits[np.argmin(counts[fits])]
            return list(range(int(starts[best]), int(starts[best]) + n))
        blocks: list[int] = []
        for i in np.argsort(-counts, kind="stable"):
            take = min(int(counts[i]), n - len(blocks))
            blocks += range(int(starts[i]), int(starts[i]) + take)
            if len(blocks) == n:
                break
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == FREED:
                continue
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; cannot add a reference")
            self._refs[b] += 1

    def take_cached(self, blocks: list[int]) -> None:
        """One more reference to each of these cached blocks (a prefix hit), taking evictable ones out of the LRU.
        ValueError for a block that is not cached."""
        assert self.cache is not None, "prefix caching is off"
        for b in blocks:
            if self.cache.hash_of(b) is None:
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                self.cache.unpark(b)
            self._refs[b] += 1

    def cache_block(self, block: int, h: int) -> bool:
        """Name the referenced, fully computed `block` by its prefix hash `h` (PrefixCache.add): it stays cached
        after its last reference. False where prefix caching is off or the name is taken."""
        if self.cache is None:
            return False
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is not held; only a held block's K/V is known")
        return self.cache.add(block, h)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block (FREED entries: none held); a block whose count reaches zero
        returns to the free list, or, if cached, becomes evictable."""
        for b in blocks:
            if b == FREED:
                continue
            if self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.cache is not None and self.cache.hash_of(b) is not None:
                    self.cache.park(b)
                else:
                    self._free[b] = True
                    self._num_free += 1

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check_integrity(self) -> None:
        """Raise AssertionError if the free mask, its count, the reference counts and the prefix cache disagree."""
        free = set(np.flatnonzero(self._free).tolist())
        if len(free) != self._num_free:
            raise AssertionError(f"{len(free)} blocks marked free, but the count says {self._num_free}")
        used = {b for b, r in enumerate(self._refs) if r > 0}
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)[:10]}")
        evictable = self.cache.check(self._refs) if self.cache is not None else set()
        if cached_free := {b for b in free if self.cache is not None and self.cache.hash_of(b) is not None}:
            raise AssertionError(f"free blocks still cached: {sorted(cached_free)[:10]}")
        if len(free) + len(used) + len(evictable) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + used {len(used)} + evictable {len(evictable)} != total {self.num_blocks}"
            )
