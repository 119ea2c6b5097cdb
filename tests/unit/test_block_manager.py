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
    bm._free[b] = True  # corrupt: a used block marked free
    bm._num_free += 1
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_detects_a_free_count_that_disagrees_with_the_mask():
    bm = BlockManager(4, 8)
    bm._num_free -= 1
    with pytest.raises(AssertionError, match="count"):
        bm.check_integrity()


def test_check_integrity_detects_a_leaked_block():
    bm = BlockManager(4, 8)
    bm._free[0] = False  # neither free nor referenced
    bm._num_free -= 1
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_detects_a_used_count_on_a_free_block():
    bm = BlockManager(4, 8)
    bm._refs[2] = 1  # referenced but still on the free list
    with pytest.raises(AssertionError):
        bm.check_integrity()


def runs_of(blocks: list[int]) -> int:
    """How many runs of consecutive ids (in table order) `blocks` is."""
    return sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)


def test_a_fresh_pool_gives_one_run():
    bm = BlockManager(16, 4)
    assert bm.allocate(5) == [0, 1, 2, 3, 4]
    assert bm.allocate(3) == [5, 6, 7]


def test_allocation_takes_the_smallest_free_run_that_holds_it():
    bm = BlockManager(20, 4)
    taken = bm.allocate(20)
    bm.free(taken[2:4])  # a hole of 2
    bm.free(taken[6:12])  # a hole of 6
    bm.free(taken[14:19])  # a hole of 5
    assert bm.free_runs() == [(2, 2), (6, 6), (14, 5)]
    assert bm.allocate(5) == [14, 15, 16, 17, 18]  # the 5-hole, not the first hole big enough (6)
    assert bm.allocate(2) == [2, 3]
    assert bm.allocate(6) == [6, 7, 8, 9, 10, 11]
    bm.check_integrity()


def test_a_fragmented_pool_gives_the_longest_runs_first():
    bm = BlockManager(20, 4)
    taken = bm.allocate(20)
    for start, count in ((0, 1), (3, 4), (9, 2), (13, 3)):
        bm.free(taken[start : start + count])
    blocks = bm.allocate(8)  # no hole holds 8: the 4-run, the 3-run, then one of the 2-run
    assert blocks == [3, 4, 5, 6, 13, 14, 15, 9]
    assert runs_of(blocks) == 3
    bm.check_integrity()


def test_a_growing_request_extends_its_run():
    bm = BlockManager(16, 4)
    first = bm.allocate(2)
    other = bm.allocate(1, after=None)  # another request takes the block right after, best fit
    assert other == [2]
    bm.free(other)
    grown = first + bm.allocate(3, after=first[-1])
    assert grown == [0, 1, 2, 3, 4]
    assert bm.allocate(1, after=1) == [5]  # block 2 is taken: no extension, the smallest hole instead
    bm.check_integrity()


def test_random_churn_keeps_integrity_and_all_or_nothing():
    import random

    rng = random.Random(0)
    bm = BlockManager(64, 4)
    held: list[list[int]] = []
    for _ in range(500):
        if held and (rng.random() < 0.45 or bm.num_free == 0):
            bm.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 12)
            if n > bm.num_free:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(n)
                continue
            one_run_possible = any(count >= n for _, count in bm.free_runs())
            blocks = bm.allocate(n)
            assert len(blocks) == n == len(set(blocks))
            if one_run_possible:
                assert runs_of(blocks) == 1, (n, blocks)
            held.append(blocks)
        bm.check_integrity()
    owned = [b for blocks in held for b in blocks]
    assert len(owned) == len(set(owned)) == 64 - bm.num_free
