"""Logical KV blocks: who holds which block, with reference counts.

Invariant (checked by `check_integrity`): every block is either free with count 0 or used with count > 0,
and free + used == total. Reference counts let two owners share a block, e.g. a request and a pending
KV export that pins it until the pull completes.

A block table entry FREED stands for a block given back while its request goes on: the tokens it held are
behind every layer's sliding window (Scheduler frees them), so no step reads them again. Table positions keep
their meaning (entry i holds positions i*B..), and `free`/`incref` pass over FREED entries.
"""

from __future__ import annotations

import numpy as np

FREED = -1  # a block table entry whose block was freed behind the sliding window (see the module docstring)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; the caller should wait or preempt."""


class BlockManager:
    """Free blocks are a mask over the pool (True: free), so that an allocation can pick where its blocks
    lie: a request whose blocks are consecutive ids is sent from the pool in few long messages (one per
    layer, plane and run; shared/kv/transfer/pool_kv.py), where scattered blocks cost a gather or a message
    per short run. `allocate` therefore prefers, in order: extending the caller's run (`after`), the
    smallest free run that holds all `n` blocks, and else the longest runs first (fewest runs)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = np.ones(num_blocks, dtype=bool)  # (num_blocks,): True where the block is free
        self._num_free = num_blocks
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0–1.0."""
        return 1.0 - self._num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` free blocks (count 1 each), as few runs of consecutive ids as the free blocks allow;
        `after`: the caller's last block, whose successors are taken if all `n` are free (a request growing
        keeps one run). All or nothing: raises NoFreeBlocksError and takes none."""
        if n > self._num_free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self._num_free} free of {self.num_blocks}")
        if n <= 0:
            return []
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

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block (FREED entries: none held); a block whose count reaches zero
        returns to the free list."""
        for b in blocks:
            if b == FREED:
                continue
            if self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = True
                self._num_free += 1

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check_integrity(self) -> None:
        """Raise AssertionError if the free mask, its count and the reference counts disagree."""
        free = set(np.flatnonzero(self._free).tolist())
        if len(free) != self._num_free:
            raise AssertionError(f"{len(free)} blocks marked free, but the count says {self._num_free}")
        used = {b for b, r in enumerate(self._refs) if r > 0}
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)[:10]}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(used)} != total {self.num_blocks}")
