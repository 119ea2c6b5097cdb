"""The SLO planner's decision replayed over signal sequences (steady, ramp, phase change, noise): which worker it
switches, when, and when it holds (hysteresis, cooldown, margin, never emptying a role)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from services.planner.capacity import Costs
from services.planner.forecast import Lengths, Load, RateForecast
from services.planner.policy import Decision, Policy, PolicyConfig, WorkerState
from shared.messages import Role

INTERVAL_S = 5.0
# a deployment where both roles can be the bottleneck: 1200 prompt tokens/s a prefill worker, a decode step of
# 30 ms + 4 ms a sequence
COSTS = Costs(prefill_tokens_per_s=1200, prefill_step_s=0.01, decode_base_s=0.03, decode_per_seq_s=0.004)
PREFILL_HEAVY = Load(1.5, Lengths(tuple([800] * 50), tuple([8.0] * 50)))  # long prompts, short answers
DECODE_HEAVY = Load(1.5, Lengths(tuple([60] * 50), tuple([300.0] * 50)))  # short prompts, long answers
CONFIG = PolicyConfig(ttft_slo_s=2.5, tpot_slo_s=0.1, margin=0.2, confirm=2, cooldown_s=30.0)


def workers(prefill: int, decode: int) -> list[WorkerState]:
    return [WorkerState(f"p{i}", Role.PREFILL, load=i) for i in range(prefill)] + [
        WorkerState(f"d{i}", Role.DECODE, load=i) for i in range(decode)
    ]


def replay(policy: Policy, loads: list[Load], pool: list[WorkerState]) -> list[Decision]:
    """Each interval's decision, its switch applied to the pool at once (as a switch that completes)."""
    decisions = []
    for i, load in enumerate(loads):
        d = policy.decide(i * INTERVAL_S, load, COSTS, pool)
        if d.switch is not None:
            pool[:] = [
                dataclasses.replace(w, role=d.switch.to_role) if w.worker_id == d.switch.worker_id else w for w in pool
            ]
        decisions.append(d)
    return decisions


def switches(decisions: list[Decision]) -> list[tuple[float, str, Role]]:
    return [(d.at, d.switch.worker_id, d.switch.to_role) for d in decisions if d.switch is not None]


def split(pool: list[WorkerState]) -> tuple[int, int]:
    prefill = sum(w.role is Role.PREFILL for w in pool)
    return prefill, len(pool) - prefill


def test_steady_prefill_heavy_load_moves_decode_workers_to_prefill_then_stays():
    pool = workers(1, 3)
    decisions = replay(Policy(CONFIG), [PREFILL_HEAVY] * 30, pool)
    moves = switches(decisions)
    # confirmed on the second interval, then one more after the cooldown: 1+3 → 2+2 → 3+1, and no further
    assert moves[0][0] == 1 * INTERVAL_S and moves[0][2] is Role.PREFILL
    assert [to for _, _, to in moves] == [Role.PREFILL, Role.PREFILL]
    assert moves[1][0] - moves[0][0] >= CONFIG.cooldown_s
    assert split(pool) == (3, 1)
    assert decisions[-1].reason == "the current split is the best"


def test_the_least_loaded_worker_of_the_donor_role_moves():
    pool = [WorkerState("busy", Role.DECODE, load=9), WorkerState("idle", Role.DECODE, load=0)]
    pool.append(WorkerState("p", Role.PREFILL))
    moved = switches(replay(Policy(CONFIG), [PREFILL_HEAVY] * 2, pool))
    assert moved == [(INTERVAL_S, "idle", Role.PREFILL)]


def test_phase_change_moves_workers_back_after_the_cooldown():
    pool = workers(1, 3)
    loads = [PREFILL_HEAVY] * 20 + [DECODE_HEAVY] * 30
    moves = switches(replay(Policy(CONFIG), loads, pool))
    to_prefill = [at for at, _, to in moves if to is Role.PREFILL]
    to_decode = [at for at, _, to in moves if to is Role.DECODE]
    assert to_prefill and all(at < 20 * INTERVAL_S for at in to_prefill)
    assert to_decode and all(at >= 20 * INTERVAL_S for at in to_decode)
    # the first move back is confirmed one interval after the phase changed (or waits out the cooldown)
    assert to_decode[0] >= max(20 * INTERVAL_S + INTERVAL_S, to_prefill[-1] + CONFIG.cooldown_s)
    times = [at for at, _, _ in moves]
    assert all(b - a >= CONFIG.cooldown_s for a, b in zip(times, times[1:], strict=False))
    assert split(pool) == (1, 3)


def test_noise_that_flips_every_interval_moves_nothing():
    pool = workers(2, 2)
    # each interval's best split points the other way: never confirmed twice in a row
    loads = [PREFILL_HEAVY if i % 2 else DECODE_HEAVY for i in range(40)]
    decisions = replay(Policy(CONFIG), loads, pool)
    assert switches(decisions) == []
    assert split(pool) == (2, 2)
    assert any("1 of 2 intervals" in d.reason for d in decisions)


def test_without_hysteresis_the_same_noise_would_flap():
    """The guard above is what holds: with confirm=1 and no cooldown the policy follows every interval."""
    pool = workers(2, 2)
    loads = [PREFILL_HEAVY if i % 2 else DECODE_HEAVY for i in range(10)]
    eager = dataclasses.replace(CONFIG, confirm=1, cooldown_s=0.0)
    assert len(switches(replay(Policy(eager), loads, pool))) >= 5


def test_a_worse_split_within_the_margin_is_not_acted_on():
    pool = workers(2, 2)
    mild = Load(0.9, Lengths(tuple([800] * 50), tuple([8.0] * 50)))  # 2+2 meets the SLOs; 3+1 only a bit better
    decisions = replay(Policy(CONFIG), [mild] * 10, pool)
    assert switches(decisions) == []
    assert "within the margin" in decisions[-1].reason


def test_two_workers_never_switch_and_a_role_is_never_emptied():
    for pool in (workers(1, 1), workers(1, 3), workers(3, 1)):
        for loads in ([PREFILL_HEAVY] * 40, [DECODE_HEAVY] * 40):
            p = list(pool)
            replay(Policy(CONFIG), loads, p)
            assert min(split(p)) >= 1
    assert switches(replay(Policy(CONFIG), [PREFILL_HEAVY] * 10, workers(1, 1))) == []


def test_idle_or_missing_roles_hold():
    low = dataclasses.replace(PREFILL_HEAVY, rate=0.01)
    assert "below min_rate" in Policy(CONFIG).decide(0, low, COSTS, workers(1, 3)).reason
    assert "no worker" in Policy(CONFIG).decide(0, PREFILL_HEAVY, COSTS, workers(0, 3)).reason
    drained = [dataclasses.replace(w, draining=True) if w.role is Role.PREFILL else w for w in workers(1, 3)]
    assert "no worker" in Policy(CONFIG).decide(0, PREFILL_HEAVY, COSTS, drained).reason


def test_a_switch_in_progress_holds_the_next():
    policy = Policy(CONFIG)
    policy.decide(0, PREFILL_HEAVY, COSTS, workers(1, 3))
    held = policy.decide(INTERVAL_S, PREFILL_HEAVY, COSTS, workers(1, 3), switching=True)
    assert held.switch is None and held.reason == "a switch is in progress"
    assert policy.decide(2 * INTERVAL_S, PREFILL_HEAVY, COSTS, workers(1, 3)).switch is not None


def test_wanted_counts_follow_the_load_and_ramp():
    policy = Policy(CONFIG)
    forecast = RateForecast()
    wanted = []
    for i in range(12):  # the rate ramps 0.5 → 6 req/s
        forecast.observe(0.5 * (i + 1))
        load = dataclasses.replace(PREFILL_HEAVY, rate=forecast.next())
        wanted.append(policy.decide(i * INTERVAL_S, load, COSTS, workers(2, 2)).wanted)
    prefill = [w["prefill"] for w in wanted]
    assert prefill == sorted(prefill) and prefill[-1] > prefill[0]
    assert forecast.next() > 0.5 * 12  # Holt's trend: the forecast leads a ramp, not lags it
    decode_heavy = policy.decide(0, DECODE_HEAVY, COSTS, workers(2, 2)).wanted
    assert decode_heavy["decode"] >= 2 and decode_heavy["prefill"] == 1


def test_the_decision_record_carries_its_signals():
    record = Policy(CONFIG).decide(0, PREFILL_HEAVY, COSTS, workers(1, 3)).record()
    assert record["action"] == "hold"
    assert record["current"] == {"prefill": 1, "decode": 3}
    assert record["best"] == {"prefill": 3, "decode": 1}
    assert record["forecast"]["prompt_p90"] == 800
    assert record["predictions"]["current"]["ttft_p90_ms"] == -1.0  # cannot keep up: no finite TTFT


def test_config_refuses_nonsense():
    bads: list[dict[str, Any]] = [
        {"margin": 1.0},
        {"confirm": 0},
        {"ttft_slo_s": 0},
        {"headroom": 0},
        {"cooldown_s": -1},
    ]
    for bad in bads:
        with pytest.raises(ValueError):
            PolicyConfig(**bad)
