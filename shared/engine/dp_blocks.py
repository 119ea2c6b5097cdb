"""The leader's block manager under data-parallel attention: one id space over every DP rank's pool.

Each of the R ranks holds a pool of N blocks of its own. The leader's scheduler sees R * N global blocks, global
block g being local block g // R of rank g % R (dp_step.py), and a request's blocks all lie on one rank: the rank
that runs its attention, its DP rank. So the scheduler, the forks and the KV imports work unchanged on global ids,
and the rank of a request follows from its blocks:

- an allocation that extends a request (`after`: its last block) stays on that block's rank;
- a request's first allocation (admission, a KV import) goes to the least loaded rank: the fewest running
  sequences (`seqs_of`, counted from the block tables the scheduler holds), then the most free blocks, then the
  lowest rank; a rank that cannot hold the blocks is passed over.

No prefix cache: a cached prefix would tie a request to the rank that computed it (not done yet: prefix caching
is off under --dp-attention, logged at start).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.engine.block_manager import FREED, BlockManager, NoFreeBlocksError
from shared.engine.request import Request


class DpBlockManager(BlockManager):
    def __init__(self, world: int, per_rank: int, block_size: int) -> None:
        super().__init__(world * per_rank, block_size, cache=None)
        self.world, self.per_rank = world, per_rank
        self._rank_free = [per_rank] * world  # free blocks per rank (no evictable ones: no prefix cache)
        # rank → its running sequences (set by the engine's builder: the scheduler's view); default: none counted
        self.seqs_of: Callable[[], list[int]] = lambda: [0] * world

    def rank_free(self, rank: int) -> int:
        return self._rank_free[rank]

    def rank_of(self, block: int) -> int:
        return block % self.world

    def _rank_for(self, n: int, after: int | None) -> int | None:
        """The rank an allocation of `n` blocks goes to; None where none can hold them."""
        if after is not None and after >= 0:
            rank = self.rank_of(after)
            return rank if self._rank_free[rank] >= n else None
        seqs = self.seqs_of()
        fits = [r for r in range(self.world) if self._rank_free[r] >= n]
        return min(fits, key=lambda r: (seqs[r], -self._rank_free[r], r), default=None)

    def can_allocate(self, n: int, after: int | None = None) -> bool:
        return n <= 0 or self._rank_for(n, after) is not None

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks on one rank (module doc): consecutive local ids where that rank's free blocks allow."""
        if n <= 0:
            return []
        rank = self._rank_for(n, after)
        if rank is None:
            raise NoFreeBlocksError(f"asked for {n} KV blocks on one DP rank, free per rank: {self._rank_free}")
        mask = self._free[rank :: self.world]  # a view: this rank's blocks by local id
        nxt = after // self.world + 1 if after is not None and after >= 0 else None
        if nxt is not None and nxt + n <= self.per_rank and mask[nxt : nxt + n].all():
            local = list(range(nxt, nxt + n))
        else:
            local = _from_runs(mask, n)
        blocks = [b * self.world + rank for b in local]
        self._free[blocks] = False
        self._num_free -= n
        self._rank_free[rank] -= n
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            was_free = b >= 0 and bool(self._free[b])
            super().free([b])
            if b >= 0 and not was_free and self._free[b]:
                self._rank_free[self.rank_of(b)] += 1

    def check_integrity(self) -> None:
        super().check_integrity()
        counted = [int(self._free[r :: self.world].sum()) for r in range(self.world)]
        if counted != self._rank_free:
            raise AssertionError(f"free blocks per rank {counted}, the counters say {self._rank_free}")


def _from_runs(mask: np.ndarray, n: int) -> list[int]:
    """`n` free local ids of one rank: the smallest run holding them all, else the longest runs first (as
    BlockManager does over the whole pool)."""
    edges = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    counts = np.flatnonzero(edges == -1) - starts
    fits = np.flatnonzero(counts >= n)
    if fits.size:
        best = int(starts[fits[np.argmin(counts[fits])]])
        return list(range(best, best + n))
    local: list[int] = []
    for i in np.argsort(-counts, kind="stable"):
        take = min(int(counts[i]), n - len(local))
        local += range(int(starts[i]), int(starts[i]) + take)
        if len(local) == n:
            break
    return local


def running_per_rank(running: list[Request], world: int) -> list[int]:
    """Running sequences per DP rank (a request admitted without blocks yet counts nowhere)."""
    counts = [0] * world
    for req in running:
        table = req.group_tables[0].blocks if req.group_tables else []
        block = next((b for b in table if b != FREED), None)
        if block is not None:
            counts[block % world] += 1
    return counts
