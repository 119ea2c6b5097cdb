"""Live expert re-placement's policy and settings (torch-free parts): the plan is aligned so only changed slots
move, the minimum gain stops a useless move, every rank derives the same moves, and bad --eplb settings are
clear errors (CLI flags, environment, and a model or group they cannot apply to)."""

from __future__ import annotations

import argparse

import pytest

from services.demo_model import write_demo_checkpoint
from shared.config_fields import add_flags, from_args
from shared.engine.config import EngineConfig, EplbConfig
from shared.engine.group_model import load_rank_model
from shared.settings import WorkerSettings
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement, PlacementError
from shared.sharding.rebalance import align, decide, initial_placement, layer_changes, predicted_imbalance

SKEWED = {0: [90, 80, 70, 60, 5, 5, 5, 5]}  # the default placement puts the four hot experts on rank 0


def test_a_skewed_load_is_rebalanced_and_only_changed_slots_move() -> None:
    current = ExpertPlacement.default(8, 2, [0])
    plan = decide(current, SKEWED, redundant=0, min_gain=0.05)
    assert plan is not None
    assert plan.before == pytest.approx(predicted_imbalance(current, SKEWED)) and plan.before > 1.8
    assert plan.after < 1.1 and plan.gain > 0.4
    # aligned: a slot keeps its expert unless the plan moves that expert away
    for old, new in zip(current.layers[0], plan.target.layers[0], strict=True):
        stay = set(old) & set(new)
        assert all(new[s] == e for s, e in enumerate(old) if e in stay)
    changed = {(c.dst, c.slot) for c in plan.changes}
    assert changed == {
        (r, s) for r in range(2) for s in range(4) if current.layers[0][r][s] != plan.target.layers[0][r][s]
    }
    assert all(current.layers[0][c.src].count(c.expert) == 1 and c.src != c.dst for c in plan.changes)
    # a balanced placement is not moved again
    assert decide(plan.target, SKEWED, redundant=0, min_gain=0.0) is None


def test_min_gain_stops_a_useless_move() -> None:
    current = ExpertPlacement.default(8, 2, [0])
    mild = {0: [12, 11, 10, 10, 10, 10, 10, 9]}  # the best split gains ~2 %
    plan = decide(current, mild, redundant=0, min_gain=0.0)
    assert plan is not None and 0 < plan.gain < 0.05
    assert decide(current, mild, redundant=0, min_gain=0.05) is None
    assert decide(current, {0: [0] * 8}, redundant=0, min_gain=0.0) is None  # no load: nothing to plan from


def test_redundant_slots_replicate_the_hot_expert_and_the_plan_keeps_the_slot_count() -> None:
    start = initial_placement(8, 2, [0, 1], redundant=2)
    assert start.slots_per_rank == 5
    assert all({0, 1} <= set(slots) for slots in start.layers[0])  # no load yet: the planner's tie-break replicas
    hot = {0: [1, 1, 1, 1, 1, 500, 1, 1], 1: [1] * 8}
    plan = decide(start, hot, redundant=2, min_gain=0.05)
    assert plan is not None and plan.target.slots_per_rank == 5
    assert all(5 in slots for slots in plan.target.layers[0])  # the hot expert on both ranks
    assert plan.layers == [0]  # the even layer stays
    with pytest.raises(PlacementError, match="eplb-redundant"):
        decide(start, hot, redundant=0, min_gain=0.05)


def test_every_rank_derives_the_same_moves_and_a_rank_never_sends_to_itself() -> None:
    old = [[0, 1, 2, 3], [4, 5, 6, 7]]
    new = align(old, [[4, 5, 0, 1], [2, 3, 6, 7]])
    assert new == [[0, 1, 4, 5], [2, 3, 6, 7]]  # 0 and 1 stay in their slots on rank 0
    changes = layer_changes(0, old, new)
    assert changes == layer_changes(0, [list(s) for s in old], [list(s) for s in new])
    assert [(c.dst, c.slot, c.expert, c.src) for c in changes] == [
        (0, 2, 4, 1),
        (0, 3, 5, 1),
        (1, 0, 2, 0),
        (1, 1, 3, 0),
    ]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--eplb-window-steps", "0", "--eplb-window-steps must be at least 1"),
        ("--eplb-interval-s", "0", "--eplb-interval-s must be positive"),
        ("--eplb-interval-s", "-3", "--eplb-interval-s must be positive"),
        ("--eplb-redundant", "-1", "--eplb-redundant must be 0 or more"),
        ("--eplb-min-gain", "1", r"--eplb-min-gain must be in \[0, 1\)"),
        ("--eplb-min-gain", "-0.1", r"--eplb-min-gain must be in \[0, 1\)"),
        ("--eplb-stage-layers", "-1", r"--eplb-stage-layers must be 0 \(all at once\) or more"),
    ],
)
def test_bad_eplb_flags_are_clear_errors(flag: str, value: str, message: str) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerSettings)
    args = parser.parse_args(["--eplb", "--ep", "2", flag, value])
    with pytest.raises(ValueError, match=message):
        from_args(WorkerSettings, args, environ={})


def test_eplb_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerSettings)
    args = parser.parse_args(["--eplb", "--ep", "2", "--eplb-window-steps", "64", "--eplb-redundant", "2"])
    settings = from_args(WorkerSettings, args, environ={"PDSERVE_EPLB_MIN_GAIN": "0.2"})
    assert settings.engine.eplb == EplbConfig(enabled=True, window_steps=64, redundant=2, min_gain=0.2)


def test_eplb_without_expert_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="--eplb .* needs ep > 1"):
        EngineConfig(model="m", eplb=EplbConfig(enabled=True))


def test_eplb_on_a_dense_model_or_with_slots_that_cannot_split_is_refused(tmp_path) -> None:
    group = RankGroup(0, 2, None)  # never runs a collective: the refusal comes before any weight is read
    dense = write_demo_checkpoint(tmp_path / "dense", arch="qwen3")
    with pytest.raises(PlacementError, match="not a mixture-of-experts model"):
        load_rank_model(EngineConfig(model=str(dense), ep=2, eplb=EplbConfig(enabled=True)), group)
    moe = write_demo_checkpoint(tmp_path / "moe", arch="qwen3_moe")
    for redundant in (1, 10):  # 9 slots over 2 ranks; more replicas than ranks can hold
        config = EngineConfig(model=str(moe), ep=2, eplb=EplbConfig(enabled=True, redundant=redundant))
        with pytest.raises(PlacementError, match=f"--eplb-redundant {redundant}"):
            load_rank_model(config, group)


def test_eplb_metrics_are_exported_per_role() -> None:
    from shared.parallel.eplb import EplbStats
    from shared.telemetry import metrics
    from shared.worker import gauges

    gauges.record_eplb(("m-eplb", "decode"), EplbStats(2, 4096, [0.01, 0.02, 0.5], 1.25))
    gauges.record_eplb(("m-eplb", "prefill"), EplbStats(1, 100, [0.2], None))
    text = metrics.exposition()[0].decode()
    assert 'pdserve:eplb_rebalances_total{model_name="m-eplb",role="decode"} 2.0' in text
    assert 'pdserve:eplb_bytes_moved_total{model_name="m-eplb",role="decode"} 4096.0' in text
    assert 'pdserve:eplb_pause_seconds_count{model_name="m-eplb",role="decode"} 3.0' in text
    assert 'pdserve:eplb_window_imbalance{model_name="m-eplb",role="decode"} 1.25' in text
    assert 'pdserve:eplb_rebalances_total{model_name="m-eplb",role="prefill"} 1.0' in text
    assert 'pdserve:eplb_window_imbalance{model_name="m-eplb",role="prefill"}' not in text
