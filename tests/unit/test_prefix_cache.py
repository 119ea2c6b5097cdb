"""The prefix cache's block side (shared/engine/prefix_cache.py, block_manager.py) and the hit rule across KV
cache groups (prefix_caching.py), on CPU without a model: cached blocks outlive their last reference as
evictable ones, are evicted least recently used first and only when the free blocks run out, never while
referenced; events net out; a hit stops at the first missing block (full attention) or needs only the blocks in
the window of its first uncached query (sliding window)."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import FREED, BlockManager, NoFreeBlocksError
from shared.engine.prefix_cache import CacheEvents, PrefixCache
from shared.engine.prefix_caching import PrefixCaching
from shared.engine.request import GroupTable, Request
from shared.engine.sampling import SamplingParams
from shared.prefix_hash import block_hashes, root_hash

B = 4


def cached_manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, B, PrefixCache(CacheEvents()))


def test_a_cached_block_outlives_its_last_reference_as_evictable():
    bm = cached_manager()
    a, b = bm.allocate(2)
    assert bm.cache_block(a, 111) and bm.cache_block(b, 222)
    bm.free([a, b])
    assert bm.num_free == 8 and bm.usage == 0.0  # evictable counts as available
    assert bm.cache is not None and bm.cache.num_evictable == 2 and bm.cache.block_of(111) == a
    bm.check_integrity()
    bm.take_cached([a])  # a hit: referenced again, out of the LRU
    assert bm.ref_count(a) == 1 and not bm.cache.is_evictable(a) and bm.num_free == 7
    bm.check_integrity()


def test_eviction_is_least_recently_used_first_and_only_when_the_free_blocks_run_out():
    bm = cached_manager(4)
    blocks = bm.allocate(4)
    for i, blk in enumerate(blocks):
        bm.cache_block(blk, 100 + i)
    bm.free([blocks[2]])
    bm.free([blocks[0]])
    bm.free([blocks[3]])  # LRU: 2, 0, 3; blocks[1] still referenced
    assert bm.cache is not None
    got = bm.allocate(2)
    assert sorted(got) == sorted([blocks[2], blocks[0]])  # the two oldest
    assert bm.cache.block_of(102) is None and bm.cache.block_of(100) is None and bm.cache.block_of(103) == blocks[3]
    assert bm.cache.evictions == 2
    bm.check_integrity()
    with pytest.raises(NoFreeBlocksError):  # block 3 evictable, block 1 referenced: never evicted
        bm.allocate(2)
    assert bm.cache.block_of(103) == blocks[3] and bm.cache.evictions == 2  # the failed call evicted nothing
    assert bm.allocate(1) == [blocks[3]]
    assert bm.cache.block_of(101) == blocks[1] and bm.ref_count(blocks[1]) == 1
    bm.check_integrity()


def test_a_second_block_with_a_taken_hash_stays_unnamed_and_frees_normally():
    bm = cached_manager()
    a, b = bm.allocate(2)
    assert bm.cache_block(a, 7)
    assert bm.cache_block(a, 7)  # idempotent
    assert not bm.cache_block(b, 7)  # same K/V computed twice: the first keeps the name
    assert not bm.cache_block(a, 8)  # one name per block
    bm.free([b])
    assert bm.cache is not None and bm.cache.num_evictable == 0 and bm.ref_count(b) == 0
    bm.check_integrity()


def test_only_a_held_block_can_be_named_and_only_a_cached_block_taken():
    bm = cached_manager()
    with pytest.raises(ValueError):
        bm.cache_block(0, 1)
    with pytest.raises(ValueError):
        bm.take_cached([0])
    assert not BlockManager(4, B).cache_block(0, 1)  # caching off: nothing is named


def test_check_integrity_catches_a_cached_block_that_is_both_referenced_and_evictable():
    bm = cached_manager()
    (a,) = bm.allocate(1)
    bm.cache_block(a, 5)
    assert bm.cache is not None
    bm.cache.park(a)  # corrupt: evictable while referenced
    with pytest.raises(AssertionError, match="evictable"):
        bm.check_integrity()


def test_check_integrity_catches_maps_that_disagree_and_a_lost_evictable_block():
    bm = cached_manager()
    (a,) = bm.allocate(1)
    bm.cache_block(a, 5)
    bm.free([a])
    assert bm.cache is not None
    bm.cache._block_of[5] = a + 1  # corrupt the hash → block map
    with pytest.raises(AssertionError, match="maps"):
        bm.check_integrity()
    bm.cache._block_of[5] = a
    bm.cache._evictable.clear()  # corrupt: a cached block nobody holds, not evictable
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_events_net_out_between_takes_and_overflow_asks_for_a_snapshot():
    ev = CacheEvents(limit=4)
    ev.stored(1)
    ev.stored(2)
    ev.removed(2)  # stored and evicted since the last take: nothing to say
    assert ev.take().stored == [1]
    ev.removed(1)
    ev.stored(1)  # held at the last take, evicted and back: nothing to say
    ev.removed(3)
    out = ev.take()
    assert (out.stored, out.removed, out.overflowed) == ([], [3], False)
    for h in range(5):
        ev.stored(h)
    out = ev.take()
    assert out.overflowed and out.stored == [] and out.removed == []
    assert not ev.take().overflowed  # a fresh start from the snapshot


# ---- the hit rule across groups -------------------------------------------------------------------------


def _request(n_tokens: int, salt: str = "") -> Request:
    return Request("r", list(range(10, 10 + n_tokens)), SamplingParams(max_tokens=4), cache_salt=salt)


def _cache(bm: BlockManager, hashes: list[int], present: list[int]) -> dict[int, int]:
    """Name fresh blocks of `bm` by hashes[i] for i in `present`, then let them go (evictable)."""
    named = {}
    for i in present:
        (blk,) = bm.allocate(1)
        assert bm.cache_block(blk, hashes[i])
        named[i] = blk
    bm.free(list(named.values()))
    return named


def test_a_full_attention_hit_stops_at_the_first_miss_and_leaves_the_last_token():
    bm = cached_manager(32)
    prefix = PrefixCaching("m", B, bm.cache)  # type: ignore[arg-type]
    req = _request(6 * B)  # 6 full blocks: at most 5 usable (the last token is computed)
    hashes = block_hashes(req.prompt_token_ids, B, root_hash("m"))
    named = _cache(bm, hashes, [0, 1, 2, 4, 5])
    table = GroupTable()
    assert prefix.take_hit(req, [(bm, None)], [table]) == 3 * B
    assert table.blocks == [named[0], named[1], named[2]] and table.freed == 0
    assert all(bm.ref_count(b) == 1 for b in table.blocks)
    bm.check_integrity()
    other = _request(6 * B, salt="tenant-b")  # the same tokens under another salt: nothing
    assert prefix.take_hit(other, [(bm, None)], [GroupTable()]) == 0


def test_a_window_group_needs_only_the_blocks_in_the_window_of_the_first_uncached_query():
    full, window = cached_manager(32), cached_manager(32)
    prefix = PrefixCaching("m", B, full.cache)  # type: ignore[arg-type]
    req = _request(8 * B + 1)  # 8 full blocks usable
    hashes = block_hashes(req.prompt_token_ids, B, root_hash("m"))
    W = 2 * B + 1  # a query at 8B reads keys from 6B on: blocks 6 and 7
    _cache(full, hashes, list(range(8)))
    named = _cache(window, hashes, [0, 1, 6, 7])  # blocks 2-5 went behind some request's window
    tables = [GroupTable(), GroupTable()]
    assert prefix.take_hit(req, [(full, None), (window, W)], tables) == 8 * B
    assert tables[1].blocks == [FREED] * 6 + [named[6], named[7]] and tables[1].freed == 6
    assert len(tables[0].blocks) == 8 and FREED not in tables[0].blocks
    full.check_integrity()
    window.check_integrity()


def test_a_window_miss_shortens_the_hit_to_where_the_window_is_whole():
    full, window = cached_manager(32), cached_manager(32)
    prefix = PrefixCaching("m", B, full.cache)  # type: ignore[arg-type]
    req = _request(8 * B + 1)
    hashes = block_hashes(req.prompt_token_ids, B, root_hash("m"))
    W = 2 * B + 1
    _cache(full, hashes, list(range(8)))
    named = _cache(window, hashes, [0, 1, 2, 3, 4, 7])  # block 6 missing: hits of 7 or 8 blocks need it
    tables = [GroupTable(), GroupTable()]
    # a hit of 6 blocks: the query at 6B reads from 4B on, blocks 4 and 5: 5 is missing too. 5 blocks: 3, 4.
    assert prefix.take_hit(req, [(full, None), (window, W)], tables) == 5 * B
    assert tables[1].blocks == [FREED] * 3 + [named[3], named[4]]
    assert len(tables[0].blocks) == 5


def test_no_hit_over_prompt_positions_whose_logprobs_are_still_wanted():
    bm = cached_manager(32)
    prefix = PrefixCaching("m", B, bm.cache)  # type: ignore[arg-type]
    req = Request("r", list(range(10, 10 + 5 * B)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    _cache(bm, block_hashes(req.prompt_token_ids, B, root_hash("m")), list(range(5)))
    assert prefix.take_hit(req, [(bm, None)], [GroupTable()]) == 0
