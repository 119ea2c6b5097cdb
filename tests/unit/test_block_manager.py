"""BlockManager: allocation, reference counts, integrity checking."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager, NoFreeBlocksError


def test_constructor_rejects_empty_pool_or_zero_block_size():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_and_free_round_trip():
    bm = BlockManager(8, 4)
    assert bm.num_free == 8
    a = bm.allocate(3)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(0 <= b < 8 for b in a)
    assert all(bm.ref_count(b) == 1 for b in a)
    assert bm.num_free == 5
    b = bm.allocate(5)
    assert set(a).isdisjoint(b)
    assert set(a) | set(b) == set(range(8))
    assert bm.num_free == 0
    bm.check_integrity()
    bm.free(a)
    assert bm.num_free == 3
    assert all(bm.ref_count(x) == 0 for x in a)
    bm.free(b)
    assert bm.num_free == 8
    bm.check_integrity()


def test_allocate_zero_takes_nothing():
    bm = BlockManager(2, 4)
    assert bm.allocate(0) == []
    assert bm.num_free == 2
    bm.check_integrity()


def test_allocation_is_all_or_nothing_on_exhaustion():
    bm = BlockManager(4, 16)
    held = bm.allocate(3)
    assert not bm.can_allocate(2)
    assert bm.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    # nothing was taken by the failed call
    assert bm.num_free == 1
    assert [bm.ref_count(b) for b in range(4)].count(0) == 1
    bm.check_integrity()
    last = bm.allocate(1)
    assert last[0] not in held
    assert bm.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    bm.check_integrity()


def test_no_free_blocks_error_is_a_runtime_error():
    bm = BlockManager(1, 1)
    bm.allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(1)


def test_incref_keeps_block_until_every_reference_is_dropped():
    bm = BlockManager(4, 8)
    blocks = bm.allocate(2)
    bm.incref(blocks)
    assert all(bm.ref_count(b) == 2 for b in blocks)
    bm.free(blocks)
    assert all(bm.ref_count(b) == 1 for b in blocks)
    assert bm.num_free == 2  # still held by the second owner
    bm.check_integrity()
    bm.free(blocks)
    assert all(bm.ref_count(b) == 0 for b in blocks)
    assert bm.num_free == 4
    bm.check_integrity()


def test_incref_on_a_free_block_raises():
    bm = BlockManager(4, 8)
    with pytest.raises(ValueError):
        bm.incref([0])
    assert bm.ref_count(0) == 0
    bm.check_integrity()


def test_double_free_raises():
    bm = BlockManager(4, 8)
    blocks = bm.allocate(2)
    bm.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(blocks)
    assert bm.num_free == 4
    bm.check_integrity()


def test_freeing_a_never_allocated_block_raises():
    bm = BlockManager(4, 8)
    bm.allocate(1)
    free_block = next(b for b in range(4) if bm.ref_count(b) == 0)
    with pytest.raises(ValueError):
        bm.free([free_block])
    assert bm.num_free == 3
    bm.check_integrity()


def test_freed_block_can_be_reallocated():
    bm = BlockManager(1, 4)
    (b,) = bm.allocate(1)
    bm.free([b])
    assert bm.allocate(1) == [b]
    assert bm.ref_count(b) == 1
    bm.check_integrity()


def test_usage_fraction():
    bm = BlockManager(4, 16)
    assert bm.usage == 0.0
    a = bm.allocate(1)
    assert bm.usage == pytest.approx(0.25)
    b = bm.allocate(3)
    assert bm.usage == pytest.approx(1.0)
    bm.incref(a)  # shared references do not count twice
    assert bm.usage == pytest.approx(1.0)
    bm.free(b)
    assert bm.usage == pytest.approx(0.25)
    bm.free(a)
    assert bm.usage == pytest.approx(0.25)
    bm.free(a)
    assert bm.usage == 0.0
    bm.check_integrity()


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5), (7, 3, 3)],
)
def test_blocks_for_rounds_up(num_tokens, block_size, expected):
    assert BlockManager(4, block_size).blocks_for(num_tokens) == expected


def test_check_integrity_detects_a_block_both_free_and_used():
    bm = BlockManager(4, 8)
    (b,) = bm.allocate(1)
    bm.check_integrity()
    bm._free.append(b)  # corrupt: a used block on the free list
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_detects_a_duplicate_in_the_free_list():
    bm = BlockManager(4, 8)
    bm._free.append(bm._free[0])
    with pytest.raises(AssertionError, match="twice"):
        bm.check_integrity()


def test_check_integrity_detects_a_leaked_block():
    bm = BlockManager(4, 8)
    bm._free.popleft()  # neither free nor referenced
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_detects_a_used_count_on_a_free_block():
    bm = BlockManager(4, 8)
    bm._refs[2] = 1  # referenced but still on the free list
    with pytest.raises(AssertionError):
        bm.check_integrity()
