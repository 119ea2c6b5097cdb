"""The pieces of the fast KV paths on their own: sends straight from the pool (pool_kv.py, wire.py's
block-run cut) and the shared segments of same-host pairs (shm.py). Across processes: test_kv_transfer.py."""

from __future__ import annotations

import gc
import os
import subprocess

import pytest
import torch

from shared.engine.kv_pool import KVLayout, KVPool, block_runs
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.shm import PREFIX, Regions, Segment, host_identity, sweep_stale
from shared.kv.transfer.wire import announce, announced_layout, pieces, receive_pieces

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SEGMENT_BYTES = 4 * 2 * 8 * 4  # one block of one layer's plane: 256 bytes


@pytest.fixture
def pool() -> KVPool:
    pool = KVPool(LAYOUT, num_blocks=16)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    return pool


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9, 10, 2, 0, 1]) == [(3, 3), (9, 2), (2, 1), (0, 2)]


@pytest.mark.parametrize("block_ids", [list(range(2, 14)), [9, 10, 11, 12, 0, 1, 2, 3], [7, 8, 2, 3, 4, 12, 0], [5]])
def test_read_copies_runs_or_gathers_the_same_bytes(pool, block_ids):
    """Long runs of consecutive blocks are copied as slices, scattered ids gathered: the same tensor either way,
    with or without `out`."""
    expected = pool.tensor.index_select(2, torch.tensor(block_ids))
    assert torch.equal(pool.read(block_ids), expected)
    out = torch.full_like(expected, float("nan"))
    assert pool.read(block_ids, out=out) is out and torch.equal(out, expected)


# Thresholds that force each way: flat (everything is small), direct (every run is worth a message),
# layered (no run is).
MODES = {"flat": (1 << 30, 0), "direct": (0, 0), "layered": (0, 1 << 30)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_ids", [[0, 1, 2, 3, 4], [7, 8, 2, 3, 4, 12, 0], [15]])
@pytest.mark.parametrize("chunk_bytes", [0, SEGMENT_BYTES, 1000, 3])
def test_what_the_pool_sends_is_what_the_receiver_cuts(pool, mode, block_ids, chunk_bytes):
    """The sender's pieces (views of the pool, or of a gathered layer) and the receiver's cut of its buffer
    match one to one in size; filled in order, the buffer is byte for byte the export of those blocks."""
    small, segment = MODES[mode]
    kv = PoolKv.plan(pool, 4 * len(block_ids) - 1, block_ids, lambda shape, dtype: torch.empty(shape, dtype=dtype),
                     small_kv_bytes=small, min_segment_bytes=segment)  # fmt: skip
    assert kv.mode == mode
    expected = pool.read(block_ids)
    assert kv.shape == tuple(expected.shape) and kv.nbytes == expected.numel() * 4
    reply = announce(LAYOUT, kv.num_tokens, kv.shape, 1, chunk_bytes, kv.runs)
    assert announced_layout(reply, LAYOUT) == LAYOUT  # the receiver accepts the announcement
    sent = list(kv.pieces(chunk_bytes))
    received = torch.empty_like(expected)
    mine = receive_pieces(received, reply)
    assert len(sent) == len(mine) == kv.num_pieces(chunk_bytes)
    for theirs, ours in zip(sent, mine, strict=True):
        assert theirs.is_contiguous() and ours.is_contiguous() and theirs.shape == ours.shape
        ours.copy_(theirs)  # what a gloo send + recv of one piece does
    assert torch.equal(received, expected)
    if mode == "direct":  # no copy: every piece is memory of the pool itself
        base = pool.tensor.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base for p in sent)
        assert kv.runs == [count for _, count in block_runs(block_ids)] and kv.staging is None
    out = torch.empty_like(expected)
    kv.copy_into(out)
    assert torch.equal(out, expected)


def test_the_default_thresholds_choose_by_size_and_contiguity():
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=256, dtype="float32")  # 128 KiB a segment
    pool = KVPool(big, num_blocks=16)

    def alloc(shape, dtype):
        return torch.empty(shape, dtype=dtype)

    assert PoolKv.plan(pool, 10, [3], alloc).mode == "flat"  # 512 KiB in all
    assert PoolKv.plan(pool, 1000, [4, 5, 6, 7], alloc).mode == "direct"  # one run of 512 KiB per segment
    assert PoolKv.plan(pool, 1000, [1, 3, 5, 7], alloc).mode == "layered"  # runs of 128 KiB
    with pytest.raises(ValueError, match="host memory"):
        PoolKv.plan(KVPool(big, 2, device="meta"), 10, [0], alloc)


def test_a_block_run_announcement_must_cut_the_blocks(pool):
    for runs in ([2, 2], [5, 1], [0, 5], [1, 1, 1, 1, 1, 1]):
        reply = announce(LAYOUT, 19, (3, 2, 5, 4, 2, 8), 1, 0, runs)
        with pytest.raises(Exception, match="runs"):
            announced_layout(reply, LAYOUT)


def test_flat_pieces_unchanged():
    t = torch.arange(64.0)
    assert pieces(t, 0) == [t] and len(pieces(t, 64)) == 4


# ---- shared segments --------------------------------------------------------------------------------------


def test_host_identity_is_stable_and_names_this_kernel():
    ident = host_identity()
    assert ident and ident == host_identity()
    assert open("/proc/sys/kernel/random/boot_id").read().strip() in ident


def test_a_segment_is_mapped_by_both_sides_and_leaves_no_name(tmp_path):
    created = Segment.create(1 << 16, tmp_path)
    assert created.name.startswith(f"{PREFIX}{os.getpid()}-") and (tmp_path / created.name).exists()
    assert oct((tmp_path / created.name).stat().st_mode & 0o777) == "0o600"
    attached = Segment.attach(created.name, 1 << 16, tmp_path)
    assert list(tmp_path.iterdir()) == []  # the second mapper unlinks at once
    created.unlink()  # the creator's unlink after the pair formed: idempotent
    written = created.view(128, (4, 8), torch.float32)
    written.copy_(torch.arange(32.0).view(4, 8))
    assert torch.equal(attached.view(128, (4, 8), torch.float32), torch.arange(32.0).view(4, 8))
    with pytest.raises(ValueError, match="fit"):
        attached.view((1 << 16) - 64, (4, 8), torch.float32)
    with pytest.raises(ValueError, match="not a KV segment"):
        Segment.attach("../etc/passwd", 1 << 16, tmp_path)
    again = Segment.create(1 << 12, tmp_path)
    with pytest.raises(ValueError, match="bytes"):
        Segment.attach(again.name, 1 << 13, tmp_path)
    assert list(tmp_path.iterdir()) == []  # a refused attach unlinks too


def test_an_oversized_segment_fails_cleanly(tmp_path):
    with pytest.raises(OSError):
        Segment.create(1 << 62, tmp_path)  # fallocate refuses (no SIGBUS later)
    assert list(tmp_path.iterdir()) == []


def test_sweep_removes_segments_of_dead_processes_only(tmp_path):
    proc = subprocess.Popen(["true"])  # a pid that no longer runs once waited for
    proc.wait(30)
    dead = f"{PREFIX}{proc.pid}-abc"
    live = f"{PREFIX}{os.getpid()}-def"
    for name in (dead, live, "unrelated-123-x"):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "unrelated-123-x"])


def test_a_region_is_free_again_once_its_tensor_and_views_are_gone(tmp_path):
    segment = Segment.create(1 << 12, tmp_path)
    regions = Regions(1 << 12)
    offset, capacity = regions.reserve()
    assert (offset, capacity) == (0, 1 << 12) and regions.reserve() == (0, 0)
    regions.keep(offset, capacity, 100)  # 100 bytes used: 128 kept (aligned), the rest free
    assert regions.free_bytes == (1 << 12) - 128
    t = segment.view(offset, (25,), torch.float32, on_free=lambda: regions.free(offset, 128))
    view = t[5:]
    del t
    gc.collect()
    assert regions.free_bytes == (1 << 12) - 128  # a view still holds the memory
    del view
    gc.collect()
    assert regions.free_bytes == 1 << 12
    assert regions.reserve() == (0, 1 << 12)  # neighbours merged into one extent again
