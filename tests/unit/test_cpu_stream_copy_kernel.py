"""The streaming-store gather (shared/model/kernels/cpu_stream_copy.c) against torch's copy of the same bytes,
and the same-host send's use of it (PoolKv.copy_into(streaming=True) against KVPool.read)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.transfer import segment_send
from shared.kv.transfer.pool_kv import PoolKv
from shared.model.kernels import cpu_stream_copy

LIB = cpu_stream_copy.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU streaming copy cannot be built on this host")


def _pieces(src: torch.Tensor, offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """The reference: the pieces of src's bytes, concatenated, by torch."""
    raw = src.view(-1).view(torch.uint8)
    return torch.cat([raw[o : o + n] for o, n in zip(offsets, lengths, strict=True)])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "offsets, lengths",
    [
        ([0], [5]),  # shorter than one streamed line: memcpy only
        ([3], [4 << 20]),  # one big piece, the source off alignment
        ([0, 1 << 20, 7], [1 << 19, 3 << 19, 999_937]),  # pieces out of order, odd sizes (threads split mid-piece)
        ([64 * i for i in range(0, 4000, 2)], [64] * 2000),  # many one-line pieces
        ([11, 0], [0, 1 << 21]),  # an empty piece
    ],
)
def test_the_gather_copies_exactly_the_pieces(threads, offsets, lengths):
    src = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    expected = _pieces(src, offsets, lengths)
    for dst_offset in (0, 1, 40):  # the destination on and off 16-byte alignment
        backing = torch.zeros(expected.numel() + dst_offset + 64, dtype=torch.uint8)
        out = backing[dst_offset : dst_offset + expected.numel()]
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cpu_stream_copy.gather(LIB, out, src, torch.tensor(offsets), torch.tensor(lengths))
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(out, expected)
        assert not backing[:dst_offset].any() and not backing[dst_offset + expected.numel() :].any()  # no overrun


@needs_kernel
def test_bad_pieces_are_refused_before_any_copy():
    src, out = torch.zeros(1000, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        cpu_stream_copy.gather(LIB, out, src, torch.tensor([950]), torch.tensor([100]))
    with pytest.raises(ValueError, match="outside"):
        cpu_stream_copy.gather(LIB, out, src, torch.tensor([-1]), torch.tensor([100]))
    with pytest.raises(ValueError, match="hold 50 bytes"):
        cpu_stream_copy.gather(LIB, out, src, torch.tensor([0]), torch.tensor([50]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_stream_copy.gather(
            LIB, torch.zeros(10, 20, dtype=torch.uint8).t(), src, torch.tensor([0]), torch.tensor([200])
        )
    with pytest.raises(ValueError, match="differ"):
        cpu_stream_copy.gather(LIB, out, src, torch.tensor([0, 50]), torch.tensor([100]))
    # a view into the middle of a storage: its bytes start at the view, not at the storage
    with pytest.raises(ValueError, match="outside"):
        cpu_stream_copy.gather(LIB, out, src[950:], torch.tensor([0]), torch.tensor([100]))


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "block_ids",
    [list(range(5, 37)), [3, 4, 5, 9, 10, 30, 31, 32, 33, 0], [17], [8, 2, 40, 1]],  # runs, ragged, one, scattered
)
def test_the_same_host_send_gathers_what_the_pool_read_gives(dtype, block_ids):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=24, block_size=4, dtype=dtype)
    pool = KVPool(layout, num_blocks=48)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(2)))
    kv = PoolKv.plan(pool, len(block_ids) * 4, block_ids, lambda shape, dt: torch.empty(shape, dtype=dt))
    expected = pool.read(block_ids)
    # into a shared mapping, as the server writes the pair's segment (shm.py), at an offset
    mapping = mmap.mmap(-1, 2 * expected.numel() * expected.element_size() + 4096)
    region = torch.from_numpy(
        np.frombuffer(mapping, dtype=np.uint8, count=expected.numel() * expected.element_size(), offset=4096)
    )
    region = region.view(expected.dtype).view(expected.shape)
    kv.copy_into(region, streaming=True)
    assert torch.equal(region, expected)
    del region


def test_without_the_kernel_the_send_copies_with_torch(monkeypatch):
    monkeypatch.setattr(cpu_stream_copy, "load", lambda: None)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=2, dtype="float32")
    pool = KVPool(layout, num_blocks=8)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    kv = PoolKv.plan(pool, 6, [1, 2, 5], lambda shape, dt: torch.empty(shape, dtype=dt))
    out = torch.empty(kv.shape)
    kv.copy_into(out, streaming=True)
    assert torch.equal(out, pool.read([1, 2, 5]))


def test_streaming_starts_at_three_quarters_of_the_largest_cache(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()  # a level sysfs lists without a readable size is skipped
    (tmp_path / "index8").mkdir()
    (tmp_path / "index8" / "size").write_text("\n")  # so is an empty one
    assert cpu_stream_copy.min_bytes(tmp_path) == 24 << 20
    assert cpu_stream_copy.min_bytes(tmp_path / "nothing-here") == cpu_stream_copy.DEFAULT_MIN_BYTES


@needs_kernel
@pytest.mark.parametrize("min_bytes, streamed", [(0, True), (1 << 40, False)])
def test_the_same_host_send_streams_only_what_the_cache_would_not_keep(monkeypatch, min_bytes, streamed):
    gathers = []
    real_gather = cpu_stream_copy.gather
    monkeypatch.setattr(cpu_stream_copy, "min_bytes", lambda: min_bytes)
    monkeypatch.setattr(cpu_stream_copy, "gather", lambda *args: gathers.append(args) or real_gather(*args))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    pool = KVPool(layout, num_blocks=16)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    kv = PoolKv.plan(pool, 24, [2, 3, 4, 9, 10, 11], lambda shape, dt: torch.empty(shape, dtype=dt))
    region = torch.zeros(kv.shape)
    segment_send.copy_into_region(kv, region)
    assert len(gathers) == (1 if streamed else 0)
    assert torch.equal(region, pool.read([2, 3, 4, 9, 10, 11]))
