"""Logical KV blocks: who holds which block, with reference counts.

Invariant (checked by `check_integrity`): every block is either free with count 0 or used with count > 0,
and free + used == total. Reference counts let two owners share a block, e.g. a request and a pending
KV export that pins it until the pull completes.

A block table entry FREED stands for a block given back while its request goes on: the tokens it held are
behind every layer's sliding window (Scheduler frees them), so no step reads them again. Table positions keep
their meaning (entry i holds positions i*B..), and `free`/`incref` pass over FREED entries.
"""

from __future__ import annotations

from collections import deque

FREED = -1  # a block table entry whose block was freed behind the sliding window (see the module docstring)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; the caller should wait or preempt."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0–1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (count 1 each). All or nothing: raises NoFreeBlocksError and takes none."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
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
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and the reference counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        used = {b for b, r in enumerate(self._refs) if r > 0}
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)[:10]}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(used)} != total {self.num_blocks}")
