"""A request's KV lent in place: blocks of another engine's pool, read through a mapping of it, not a copy.

A decode worker on the same host as the prefill worker that holds a request's KV maps that worker's pool
(shared_pool.py) and borrows the request's blocks (shared/kv/transfer/client.py): the pull moves no bytes. The
import then copies the blocks straight from the lender's pool into its own (`write_into`): the hand-off's only
copy. Until it gives them back (`release`), the lender keeps the blocks; `still_lent()` says whether it still does
(the lender may take them back only after ending the connection the loan came over, which this reads), and a
copy is trusted only if the loan held until it ended: else BorrowRevoked, and the caller recomputes.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool


class BorrowRevoked(RuntimeError):
    """The lender took the blocks back before a copy of them ended: what was copied may be another request's."""


class _Loan:
    """The release of one loan, once, from any thread (an import's, the loop's, or the garbage collector's)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


class BorrowedKv(KVExport):
    """KV of `num_tokens` tokens in blocks `block_ids` (from `first_block` of the request on) of `source`, the
    lender's pool tensor (L, P, N, B, KVH, hd). `blocks` gathers them (a copy, checked); an import copies them
    into its pool directly (`write_into`). Released once: by `release()`, or when garbage-collected."""

    def __init__(
        self,
        layout: KVLayout,
        num_tokens: int,
        source: torch.Tensor,
        block_ids: list[int],
        *,
        first_block: int = 0,
        still_lent: Callable[[], bool],
        release: Callable[[], None],
    ) -> None:
        # not KVExport.__init__: there is no `blocks` tensor until someone asks for a copy
        self.layout, self.num_tokens, self.first_block, self.parts = layout, num_tokens, first_block, ()
        self.source, self.block_ids = source, list(block_ids)
        self._still_lent = still_lent
        self._loan = _Loan(release)
        weakref.finalize(self, self._loan.release)  # a loan dropped unreleased (a failed import) goes back too

    def __repr__(self) -> str:  # the dataclass's would read `blocks`: a copy of the whole KV
        return f"BorrowedKv({self.num_tokens} tokens in {len(self.block_ids)} blocks of a lent pool)"

    @property
    def blocks(self) -> torch.Tensor:  # pyright: ignore[reportIncompatibleVariableOverride]
        """A copy of the borrowed blocks, (L, P, n, B, KVH, hd). BorrowRevoked if the loan ended under it."""
        out = torch.empty(self.layout.block_shape(len(self.block_ids)), dtype=self.source.dtype)
        copy_blocks(out, list(range(len(self.block_ids))), self.source, self.block_ids)
        self.check()
        return out

    @property
    def nbytes(self) -> int:
        return math.prod(self.layout.block_shape(len(self.block_ids))) * self.source.element_size()

    def write_into(self, pool: KVPool, block_ids: list[int]) -> None:
        """Fill `block_ids` of `pool` (the importer's) with the borrowed blocks: one copy, from the lender's pool
        into this one, where the block sizes match (else re-cut, through a gathered copy). BorrowRevoked if the
        loan ended before the copy did (the blocks written are then not this request's KV)."""
        if pool.layout.block_size != self.layout.block_size or pool.tensor.dtype != self.source.dtype:
            super().write_into(pool, block_ids)
            return
        copy_blocks(pool.tensor, block_ids, self.source, self.block_ids)
        self.check()

    def check(self) -> None:
        if not self._still_lent():
            raise BorrowRevoked("the prefill worker took its KV blocks back before they were copied")

    def release(self) -> None:
        """Give the blocks back to the lender (its pool may reuse them): once the import copied them. Idempotent."""
        self._loan.release()


def copy_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]] for every i, as one strided copy per run of blocks that are
    consecutive on both sides (a prefill's blocks and a fresh import's mostly are: one run)."""
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(src_ids)} blocks cannot fill {len(dst_ids)}")
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i < len(src_ids) and src_ids[i] == src_ids[i - 1] + 1 and dst_ids[i] == dst_ids[i - 1] + 1:
            continue
        count = i - start
        d, s = dst_ids[start], src_ids[start]
        dst[:, :, d : d + count].copy_(src[:, :, s : s + count])
        start = i
