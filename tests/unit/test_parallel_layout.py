"""Who owns what in a worker group (shared/sharding/layout.py), and the group's collectives over real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from shared.parallel.launch import local_rendezvous, spawn_followers
from shared.sharding.group import RankGroup
from shared.sharding.layout import (
    LayoutError,
    ParallelLayout,
    expert_range,
    head_range,
    kv_head_holders,
    kv_head_range,
)


def test_world_is_the_larger_degree_and_each_degree_is_one_or_the_world():
    assert ParallelLayout().world == 1 and ParallelLayout().single
    assert ParallelLayout(tp=2).world == 2
    assert ParallelLayout(ep=4).world == 4
    assert ParallelLayout(tp=2, ep=2).world == 2
    with pytest.raises(LayoutError, match="each 1 or the group size"):
        ParallelLayout(tp=2, ep=4)
    with pytest.raises(LayoutError, match="at least 1"):
        ParallelLayout(tp=0)


def test_heads_split_contiguously_and_refuse_an_uneven_split():
    assert [head_range(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    with pytest.raises(LayoutError, match="do not split over tp=3"):
        head_range(8, 3, 0)


def test_kv_heads_split_when_enough_and_replicate_when_fewer_than_ranks():
    assert [kv_head_range(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    # 2 KV heads over 4 ranks: each head on two consecutive ranks, so query heads 0..H/4 of rank 1 still find head 0
    assert [kv_head_range(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_range(1, 2, 1) == range(0, 1)
    assert kv_head_holders(2, 4) == {0: [0, 1], 1: [2, 3]}
    with pytest.raises(LayoutError, match="not a multiple"):
        kv_head_range(2, 3, 0)


def test_query_heads_of_a_rank_use_only_the_kv_heads_it_holds():
    # GQA: query head q uses KV head q // (H / KVH); every rank's query heads must map into its own KV heads
    for heads, kv_heads, tp in [(8, 2, 2), (8, 2, 4), (8, 1, 2), (16, 4, 2), (4, 4, 4)]:
        group = heads // kv_heads
        for rank in range(tp):
            needed = {q // group for q in head_range(heads, tp, rank)}
            assert needed <= set(kv_head_range(kv_heads, tp, rank)), (heads, kv_heads, tp, rank)


def test_experts_split_contiguously():
    assert [expert_range(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    with pytest.raises(LayoutError):
        expert_range(6, 4, 0)


def test_a_single_rank_group_is_the_identity():
    g = RankGroup.single()
    t = torch.ones(2)
    assert g.all_reduce_(t) is t and g.all_gather(t).equal(t) and g.broadcast_object(5) == 5


def _collectives(group: RankGroup) -> list:
    t = group.all_reduce_(torch.full((2,), float(group.rank + 1)))
    gathered = group.all_gather(torch.tensor([group.rank]), dim=0)
    obj = group.broadcast_object({"step": 7} if group.is_leader else None)
    out = group.all_to_all(torch.empty(4), torch.arange(4.0) + 10 * group.rank, [2, 2], [2, 2])
    return [t.tolist(), gathered.tolist(), obj, out.tolist()]


def _follower(group: RankGroup, queue) -> None:
    queue.put(_collectives(group))


def test_collectives_over_two_gloo_ranks():
    import multiprocessing as mp

    rdv = local_rendezvous(2, timeout_s=20)
    queue = mp.get_context("spawn").Queue()
    procs = spawn_followers(rdv, _follower, (queue,))
    leader = _collectives(RankGroup.join(rdv, 0))
    follower = queue.get(timeout=30)
    for p in procs:
        p.join(10)
    assert leader == [[3.0, 3.0], [0, 1], {"step": 7}, [0.0, 1.0, 10.0, 11.0]]
    assert follower == [[3.0, 3.0], [0, 1], {"step": 7}, [2.0, 3.0, 12.0, 13.0]]
