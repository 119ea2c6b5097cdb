"""The pull plan between groups of different TP, the group record on the wire, and the compatibility rules."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from shared.engine.kv_pool import KVLayout
from shared.kv.registry import KvLocation
from shared.kv.reslice import IncompatibleKv, check_compatible, group_pulls, group_record, plan_pulls
from shared.sharding.layout import LayoutError, kv_head_range

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="float32")


@pytest.mark.parametrize(("kvh", "a", "b"), list(itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4))))
def test_every_needed_head_once_from_a_holder(kvh: int, a: int, b: int) -> None:
    src = [kv_head_range(kvh, a, r) for r in range(a)]
    used_sources: dict[int, set[int]] = {}
    for j in range(b):
        needed = list(kv_head_range(kvh, b, j))
        plan = plan_pulls(kvh, a, b, j)
        got: list[int] = []
        for pull in plan:
            assert len(pull.heads) == len(pull.src) == len(pull.dst) >= 1
            for head, s, d in zip(pull.heads, pull.src, pull.dst, strict=True):
                assert src[pull.rank][s] == head  # the source really holds it, at that pool position
                assert needed[d] == head  # it lands where decode rank j keeps it
                used_sources.setdefault(head, set()).add(pull.rank)
            got += list(pull.heads)
        assert sorted(got) == needed  # every needed head exactly once
        # merged: no two consecutive transfers from one rank that could have been one
        for x, y in itertools.pairwise(plan):
            assert not (x.rank == y.rank and x.heads.stop == y.heads.start and x.src.stop == y.src.start)
    assert group_pulls(kvh, a, b) == sum(len(plan_pulls(kvh, a, b, j)) for j in range(b))
    # replicated heads: decode ranks sharing a head are spread over its holders
    for head, ranks in used_sources.items():
        sharers = sum(head in kv_head_range(kvh, b, j) for j in range(b))
        holders = sum(head in r for r in src)
        assert len(ranks) == min(sharers, holders)


def test_concrete_plans() -> None:
    # P TP 2 -> D TP 1, 4 heads: two transfers, each a whole prefill pool
    p = plan_pulls(4, 2, 1, 0)
    assert [(x.rank, list(x.heads), list(x.src), list(x.dst)) for x in p] == [
        (0, [0, 1], [0, 1], [0, 1]),
        (1, [2, 3], [0, 1], [2, 3]),
    ]
    # P TP 1 -> D TP 2: decode rank 1 takes heads 2, 3 of the single pool
    assert [(x.rank, list(x.src), list(x.dst)) for x in plan_pulls(4, 1, 2, 1)] == [(0, [2, 3], [0, 1])]
    # KVH 1 at P TP 2 (replicas) -> D TP 2: each decode rank its own replica
    assert [x.rank for j in range(2) for x in plan_pulls(1, 2, 2, j)] == [0, 1]


def test_bad_plans_refused() -> None:
    with pytest.raises(ValueError, match="not in a group"):
        plan_pulls(4, 2, 2, 2)
    with pytest.raises(LayoutError):
        plan_pulls(6, 4, 1, 0)


def test_single_worker_location_unchanged_on_the_wire() -> None:
    loc = KvLocation("r", "w", "h:1", 5, LAYOUT.fingerprint)
    assert msgspec.json.decode(msgspec.json.encode(loc)) == {
        "request_id": "r",
        "worker_id": "w",
        "rpc_address": "h:1",
        "num_tokens": 5,
        "fingerprint": LAYOUT.fingerprint,
    }
    group = group_record(LAYOUT, 2, ["a:1", "b:2"])
    loc = KvLocation("r", "w", "a:1", 5, LAYOUT.fingerprint, group)
    back = msgspec.json.decode(msgspec.json.encode(loc), type=KvLocation)
    assert back == loc and back.group is not None
    assert [(r.rpc_address, r.kv_heads) for r in back.group.ranks] == [("a:1", [0, 1]), ("b:2", [2, 3])]


def test_fingerprint_is_independent_of_tp_and_block_size() -> None:
    sliced = KVLayout(2, 4, 8, 16, "float32", kv_heads=(2, 3))
    assert sliced.fingerprint == LAYOUT.fingerprint
    assert sliced.num_held_kv_heads == 2 and LAYOUT.held_kv_heads == (0, 1, 2, 3)
    assert KVLayout(2, 4, 8, 4, "bfloat16").fingerprint != LAYOUT.fingerprint
    with pytest.raises(ValueError, match="kv_heads"):
        KVLayout(2, 4, 8, 4, "float32", kv_heads=(4,))


def test_compatibility_rules() -> None:
    record = group_record(LAYOUT, 2, ["a:1", "b:2"])
    check_compatible(record, LAYOUT, 1)
    check_compatible(record, KVLayout(2, 4, 8, 32, "float32"), 4)  # another block size and TP: fine
    cases = [
        (KVLayout(2, 4, 16, 4, "float32"), "head dim 8 \\(prefill\\) vs 16 \\(decode\\)"),
        (KVLayout(2, 4, 8, 4, "bfloat16"), "dtype float32 \\(prefill\\) vs bfloat16 \\(decode\\)"),
        (KVLayout(3, 2, 8, 4, "float32"), "layers 2 \\(prefill\\) vs 3 \\(decode\\), KV heads 4 \\(prefill\\) vs 2"),
    ]
    for layout, message in cases:
        with pytest.raises(IncompatibleKv, match=message):
            check_compatible(record, layout, 1)
    with pytest.raises(LayoutError):
        check_compatible(record, LAYOUT, 3)
    forged = msgspec.structs.replace(record, ranks=record.ranks[:1])
    with pytest.raises(IncompatibleKv, match="lists ranks"):
        check_compatible(forged, LAYOUT, 1)
