"""A request's KV sent straight from the pool's blocks: no export pass before the send.

`PoolKv.plan` looks at where the request's blocks lie and picks one of three ways to put them on the wire
(the receiver learns which from the reply's `runs`, wire.py):

- **direct**: the blocks form few long runs of consecutive ids (the allocator hands a fresh prefill
  consecutive blocks). Each (layer, plane, run) is one contiguous view of the pool and goes out as one
  message, with no copy at all on the sending side.
- **layered**: the blocks are scattered (runs too short to be worth a message each). Layer l is gathered
  into a staging buffer and posted; gloo moves it in its own thread while layer l + 1 is gathered, so the
  gather overlaps the wire instead of running as a whole pass before it.
- **flat**: a small KV (under `SMALL_KV_BYTES`): gathered whole and sent as one message, exactly the
  export path; a message costs more than such a copy.
- **gathered**: a small KV sent into receives posted before the Pull (posted.py): gathered whole, then sent
  as its (layer, plane) slices, the one-run cut the receiver cut without a reply.

Only for pools in host memory (gloo sends host memory). A CUDA pool's KV is exported on the send stream as
before (send_stream.py): its gather must be ordered against the compute stream. The blocks must stay
allocated, and unwritten, until the send ends: the holder (HeldKv) keeps them pinned while SENDING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shared.engine.kv_export import KVPart
from shared.engine.kv_pool import KVLayout, KVPool, block_runs
from shared.kv.transfer.wire import num_pieces, num_segment_pieces, pieces, segments
from shared.model.kernels import cpu_stream_copy

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# A (layer, plane, run) segment shorter than this is not worth a message of its own: gather by layer instead.
# At ~10 µs per gloo message on loopback, 256 KiB (~60 µs on the wire) keeps the overhead near 15%.
MIN_SEGMENT_BYTES = 256 << 10
SMALL_KV_BYTES = 1 << 20  # below this, one gathered message beats 2 × layers of them


@dataclass
class PoolKv:
    """The KV of `num_tokens` tokens in `block_ids` of `pool`, to be sent; `staging` is the buffer the layered
    and flat ways gather into (None: direct). Holds no copy until `pieces` or `copy_into` runs."""

    layout: KVLayout
    num_tokens: int
    pool: KVPool
    block_ids: list[int]
    mode: str  # "direct", "layered", "flat" or "gathered" (posted.py)
    staging: torch.Tensor | None = None
    # the request's block `block_ids` start at: those before are behind every layer's sliding window (freed)
    first_block: int = 0
    parts: tuple[KVPart, ...] = ()  # always one KV cache group: several groups send exports (KVExport.parts)

    @classmethod
    def plan(
        cls,
        pool: KVPool,
        num_tokens: int,
        block_ids: list[int],
        alloc: Alloc,
        small_kv_bytes: int = SMALL_KV_BYTES,
        min_segment_bytes: int = MIN_SEGMENT_BYTES,
        first_block: int = 0,
    ) -> PoolKv:
        """The cheapest way to send these blocks; `alloc(shape, dtype)` supplies staging memory if one is needed.
        The thresholds pick the way (module constants; tests force each)."""
        if pool.tensor.device.type != "cpu":
            raise ValueError("a send straight from the pool needs a pool in host memory; export a CUDA pool's KV")
        n = len(block_ids)
        shape = (pool.tensor.shape[0], pool.num_planes, n, *pool.tensor.shape[3:])
        segment_bytes = pool.segment(0, 0, 0, 1).nbytes  # one block of one layer's plane
        total = segment_bytes * n * shape[0] * shape[1]
        runs = block_runs(block_ids)
        if total < small_kv_bytes:
            mode = "flat"
        elif segment_bytes * n / len(runs) >= min_segment_bytes:
            mode = "direct"
        else:
            mode = "layered"
        staging = None if mode == "direct" else alloc(shape, pool.tensor.dtype)
        return cls(pool.layout, num_tokens, pool, block_ids, mode, staging, first_block)

    @property
    def shape(self) -> tuple[int, ...]:
        t = self.pool.tensor
        return (t.shape[0], self.pool.num_planes, len(self.block_ids), *t.shape[3:])

    @property
    def nbytes(self) -> int:
        return self.pool.segment(0, 0, 0, 1).nbytes * len(self.block_ids) * self.shape[0] * self.shape[1]

    @property
    def runs(self) -> list[int]:
        """What the reply announces (wire.py): block counts of the runs; [] for the flat cut."""
        if self.mode == "flat":
            return []
        if self.mode in ("layered", "gathered"):
            return [len(self.block_ids)]
        return [count for _, count in block_runs(self.block_ids)]

    def num_pieces(self, chunk_bytes: int) -> int:
        itemsize = self.pool.tensor.element_size()
        if self.mode == "flat":
            return num_pieces(self.nbytes // itemsize, itemsize, chunk_bytes)
        return num_segment_pieces(self.shape, self.runs, itemsize, chunk_bytes)

    def pieces(self, chunk_bytes: int) -> Iterator[torch.Tensor]:
        """The pieces in wire order, produced as they are asked for: a caller that posts each piece before
        asking for the next overlaps the layered gather with the wire."""
        if self.mode == "flat":
            assert self.staging is not None
            yield from pieces(self.pool.read(self.block_ids, out=self.staging), chunk_bytes)
        elif self.mode == "gathered":
            assert self.staging is not None
            gathered = self.pool.read(self.block_ids, out=self.staging)
            for layer in range(self.shape[0]):
                for plane in range(self.shape[1]):
                    yield from pieces(gathered[layer, plane], chunk_bytes)
        elif self.mode == "layered":
            assert self.staging is not None
            for layer in range(self.shape[0]):
                gathered = self.pool.read_layer(layer, self.block_ids, out=self.staging[layer])
                for plane in range(self.shape[1]):
                    yield from pieces(gathered[plane], chunk_bytes)
        else:
            runs = block_runs(self.block_ids)
            for layer, plane, i, _ in segments(self.shape[0], self.shape[1], self.runs):
                first, count = runs[i]
                yield from pieces(self.pool.segment(layer, plane, first, count), chunk_bytes)

    def copy_into(self, out: torch.Tensor, streaming: bool = False) -> None:
        """One gather of the blocks into `out` (L, planes, n, B, KVH, hd), contiguous. `streaming`: memory
        another process reads next (the shared segment), written with streaming stores where the kernel
        builds (cpu_stream_copy.c), one piece per (layer, plane, run of blocks); else torch's copy."""
        pool = self.pool.tensor
        lib = cpu_stream_copy.load() if streaming and pool.is_contiguous() and out.is_contiguous() else None
        if lib is None:
            self.pool.read(self.block_ids, out=out)
            return
        block_bytes = self.pool.segment(0, 0, 0, 1).nbytes
        firsts, counts = (torch.tensor(c, dtype=torch.int64) for c in zip(*block_runs(self.block_ids), strict=True))
        planes = torch.arange(pool.shape[0] * pool.shape[1], dtype=torch.int64)  # (layer, plane), in order
        offsets = (planes[:, None] * pool.shape[2] + firsts[None, :]) * block_bytes
        lengths = (counts * block_bytes).repeat(len(planes))
        cpu_stream_copy.gather(lib, out, pool, offsets.reshape(-1), lengths)
