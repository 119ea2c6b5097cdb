"""benchmarks/eplb_sim.py on tiny traces (pure, fast): its rank loads agree with the live policy's predicted
imbalance, its live re-placement follows the worker's timing (plan at the interval, `stage_layers` layers staged per
step boundary, swap at the next), per-phase placement beats a shared one when the phases favour different experts,
and synthetic and recorded traces feed it."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.eplb_sim import (
    POLICIES,
    PhaseTrace,
    Synthetic,
    compare,
    from_files,
    live,
    static,
    step_loads,
    zipf_weights,
)
from shared.engine.config import EplbConfig
from shared.sharding.expert_trace import ExpertTrace, TraceHeader, TraceStep, write_trace
from shared.sharding.placement import ExpertPlacement, plan_placement
from shared.sharding.rebalance import predicted_imbalance

DECODE_HOT = [90, 80, 70, 60, 5, 5, 5, 5]  # the contiguous default puts all four hot experts on rank 0
PREFILL_HOT = [5, 5, 5, 5, 90, 80, 70, 60]


def _phase(role: str, per_step: list[int], steps: int, layers: int = 1, step_s: float = 1.0) -> PhaseTrace:
    counts = np.tile(np.array(per_step, dtype=np.int64), (steps, layers, 1))
    return PhaseTrace(role, list(range(layers)), counts, np.arange(1, steps + 1) * step_s)


def test_rank_loads_agree_with_the_live_policys_predicted_imbalance() -> None:
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, size=(5, 2, 8))
    placement = plan_placement({0: [40, 3, 3, 9, 1, 1, 30, 2], 2: [1] * 8}, ep=4, redundant=4)
    busiest, mean = step_loads(counts, placement, [0, 2])
    for s in range(5):
        load = {0: counts[s, 0].tolist(), 2: counts[s, 1].tolist()}
        assert busiest[s] / mean[s] == pytest.approx(predicted_imbalance(placement, load))


def test_live_replacement_plans_at_the_interval_and_swaps_after_staging_each_changed_layer() -> None:
    hot = [90, 80, 70, 60, 0, 0, 0, 0]  # all on rank 0 by default (busiest / mean 2), 150 | 150 once planned
    trace = _phase("decode", hot, steps=12, layers=1)
    start = ExpertPlacement.default(8, 2, [0])
    eplb = EplbConfig(enabled=True, window_steps=4, interval_s=3.0, redundant=0, min_gain=0.05)
    outcome = live({"decode": trace}, ["decode"], start, eplb)["decode"]
    ratio = outcome.busiest / outcome.mean
    # steps end at t = 1, 2, ...; the boundary before step 4 sees the clock at 4 - 1 >= 3 s after the first step
    # and plans; it stages the one changed layer at the boundary before step 5 and swaps before step 6
    assert ratio[:6] == pytest.approx([2.0] * 6)
    assert ratio[6:] == pytest.approx([1.0] * 6)
    assert (outcome.rebalances, outcome.slots_moved) == (1, 4)
    # two layers: one more boundary of staging before the swap
    start = ExpertPlacement.default(8, 2, [0, 1])
    two = live({"decode": _phase("decode", hot, 12, layers=2)}, ["decode"], start, eplb)["decode"]
    assert (two.busiest / two.mean).tolist() == pytest.approx([2.0] * 7 + [1.0] * 5)
    # --eplb-stage-layers 2 (or 0, all at once): both layers staged at one boundary, the swap a step sooner
    for stage in (2, 0):
        both = EplbConfig(enabled=True, window_steps=4, interval_s=3.0, min_gain=0.05, stage_layers=stage)
        one = live({"decode": _phase("decode", hot, 12, layers=2)}, ["decode"], start, both)["decode"]
        assert (one.busiest / one.mean).tolist() == pytest.approx([2.0] * 6 + [1.0] * 6)


def test_min_gain_and_a_quiet_window_keep_the_placement() -> None:
    trace = _phase("decode", [11, 10, 10, 10, 10, 10, 10, 9], steps=12)  # the best split gains ~1 %
    start = ExpertPlacement.default(8, 2, [0])
    eplb = EplbConfig(enabled=True, window_steps=4, interval_s=1.0, redundant=0, min_gain=0.05)
    outcome = live({"decode": trace}, ["decode"], start, eplb)["decode"]
    assert outcome.rebalances == 0
    assert outcome.busiest == pytest.approx(static(trace, start).busiest)


def test_per_phase_placement_beats_a_shared_one_when_the_phases_favour_different_experts() -> None:
    # prefill's steps carry 10x decode's tokens: the summed load is prefill's, whose best split ({0, 3} | {1, 2})
    # puts both of decode's hot experts on rank 1; the contiguous default ({0, 1} | {2, 3}) suits decode only
    traces = {
        "prefill": _phase("prefill", [4000, 3000, 2000, 1000], steps=8, step_s=0.5),
        "decode": _phase("decode", [0, 60, 60, 0], steps=40, step_s=0.1),
    }
    eplb = EplbConfig(enabled=True, window_steps=4, interval_s=0.5, redundant=0, min_gain=0.05)
    result = compare(traces, ep=2, redundant=0, eplb=eplb)
    assert list(result) == list(POLICIES) and all(set(per) == {"prefill", "decode"} for per in result.values())
    imbalance = {p: {r: s["imbalance"] for r, s in per.items()} for p, per in result.items()}
    assert imbalance["default"] == {"prefill": 1.4, "decode": 1.0}
    assert imbalance["static-shared"] == {"prefill": 1.0, "decode": 2.0}
    assert imbalance["static-own"] == {"prefill": 1.0, "decode": 1.0}
    # live: each phase from its own window fixes prefill and leaves decode alone; one shared window moves decode's
    # experts together as soon as a prefill step is in it
    assert 1.0 < imbalance["live-own"]["prefill"] < 1.4 and imbalance["live-own"]["decode"] == 1.0
    assert result["live-own"]["decode"]["rebalances"] == 0 and result["live-own"]["prefill"]["rebalances"] == 1
    assert imbalance["live-shared"]["decode"] > 1.5
    assert (
        len(result["live-shared"]["decode"]["over_time"]) == 10
        and result["live-shared"]["decode"]["over_time"][-1] == 2.0
    )


def test_zipf_weights_are_capped_at_one_over_top_k() -> None:
    w = zipf_weights(np.random.default_rng(0).permutation(16), s=2.0, top_k=4)
    assert w.sum() == pytest.approx(1.0) and w.max() <= 0.25 + 1e-9
    assert sorted(w)[-1] == pytest.approx(0.25) and sorted(w)[0] > 0


def test_synthetic_traces_have_each_phases_tokens_and_shifting_hot_experts() -> None:
    synth = Synthetic(
        num_experts=16,
        top_k=2,
        layers=2,
        segments=2,
        segment_s=2.0,
        skews=(1.0,),
        prefill_tokens=64,
        prefill_step_s=0.5,
        decode_tokens=8,
        decode_step_s=0.1,
    )
    traces = synth.generate()
    assert traces["prefill"].counts.shape == (8, 2, 16) and traces["decode"].counts.shape == (40, 2, 16)
    assert (traces["prefill"].counts.sum(axis=2) == 64 * 2).all() and (traces["decode"].counts.sum(axis=2) == 16).all()
    first, second = (traces["prefill"].counts[rows, 0].sum(axis=0) for rows in (slice(0, 4), slice(4, 8)))
    assert first.argmax() != second.argmax()  # the hot expert moved between the traffic phases (seed 0)


def test_recorded_traces_feed_it(tmp_path) -> None:
    header = TraceHeader(role="decode", model="m", layers=(1,), num_experts=8, top_k=2)
    steps = [TraceStep(i, float(i), 0.01, 0, 4, (tuple(DECODE_HOT),)) for i in range(6)]
    write_trace(tmp_path / "d.jsonl", ExpertTrace(header, steps[3:]))
    write_trace(tmp_path / "d.jsonl", ExpertTrace(header, steps[:3]), append=True)  # out of order: sorted by t
    traces = from_files([str(tmp_path / "d.jsonl")])
    assert list(traces) == ["decode"] and traces["decode"].layers == [1]
    assert traces["decode"].t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    eplb = EplbConfig(enabled=True, window_steps=2, interval_s=1.0)
    result = compare(traces, ep=2, redundant=0, eplb=eplb)
    assert "live-shared" not in result and result["default"]["decode"]["imbalance"] == pytest.approx(1.875)
    assert result["static-own"]["decode"]["imbalance"] == pytest.approx(1.0)
