"""The planner's model pieces: the forecast (rate, lengths, fill ratio), the decode step's fit, the queueing
predictions and the correction learnt from measured p90s."""

from __future__ import annotations

import math

import pytest

from services.planner.capacity import Correction, Costs, StepFit, measured_costs, predict, splits
from services.planner.forecast import Lengths, LengthWindow, Load, RateForecast, percentile
from shared.messages import Heartbeat, PathCalibration, Role

COSTS = Costs(prefill_tokens_per_s=1000, prefill_step_s=0.01, decode_base_s=0.02, decode_per_seq_s=0.002)


def test_percentile_interpolates():
    assert percentile([], 0.9) == 0.0
    assert percentile([5], 0.5) == 5
    assert percentile(list(range(1, 11)), 0.9) == pytest.approx(9.1)


def test_rate_forecast_tracks_level_and_trend():
    f = RateForecast()
    assert f.next() == 0.0
    for r in (2.0, 2.0, 2.0):
        f.observe(r)
    assert f.next() == pytest.approx(2.0)
    for r in (3.0, 4.0, 5.0, 6.0):
        f.observe(r)
    assert f.next() > 6.0
    seen = []
    for _ in range(20):
        f.observe(0.0)
        seen.append(f.next())
    assert min(seen) >= 0.0  # the trend overshoots a drop, but a rate is never negative
    assert seen[-1] < 0.05


def test_output_lengths_count_at_arrival_with_the_fill_ratio():
    w = LengthWindow(window_s=60, min_samples=0)
    for i in range(10):
        w.arrived(100.0 + i, 500, 200)
    assert w.lengths(110).output(0.5) == 200  # nothing ended yet: max_tokens as asked
    w.ended(50, 200)  # clients stop at a quarter of what they ask
    assert w.lengths(110).output(0.5) == pytest.approx(50)
    assert w.lengths(200).prompts == ()  # the window forgets


def test_the_length_window_keeps_the_last_few_when_arrivals_are_sparse():
    w = LengthWindow(window_s=20, min_samples=3)
    for i, n in enumerate((100, 200, 300, 400, 500)):
        w.arrived(float(i), n, 8)
    assert w.lengths(1000).prompts == (300, 400, 500)


def test_step_fit_recovers_a_line_and_defaults_with_one_batch_size():
    fit = StepFit()
    assert fit.line() is None
    fit.observe(4, 0.02 + 0.002 * 4)
    a, c = fit.line()  # pyright: ignore[reportGeneralTypeIssues]
    assert a + c * 4 == pytest.approx(0.028)
    for b in (1, 8, 16, 32):
        fit.observe(b, 0.02 + 0.002 * b)
    a, c = fit.line()  # pyright: ignore[reportGeneralTypeIssues]
    assert (a, c) == (pytest.approx(0.02), pytest.approx(0.002))


def test_measured_costs_from_heartbeats():
    beats = [
        Heartbeat("p", Role.PREFILL, "m", None, path_calibration=PathCalibration(900.0, 5.0)),
        Heartbeat("p2", Role.PREFILL, "m", None, path_calibration=PathCalibration(1100.0, 7.0)),
        Heartbeat("d", Role.DECODE, "m", None, running=10, path_calibration=PathCalibration(decode_step_ms=40.0)),
        Heartbeat("new", Role.DECODE, "m", None),  # nothing measured yet
    ]
    costs = measured_costs(beats, StepFit())
    assert costs.prefill_tokens_per_s == 1000.0 and costs.prefill_step_s == pytest.approx(0.006)
    assert costs.decode_step_s(10) == pytest.approx(0.040)
    assert measured_costs([], StepFit()) == Costs()  # the documented defaults


def test_more_workers_never_predict_worse():
    load = Load(2.0, Lengths(tuple(range(100, 1100, 10)), tuple(float(x) for x in range(50, 250, 2))))
    ttfts = [predict(load, COSTS, p, 1).ttft_s for p in range(1, 6)]
    tpots = [predict(load, COSTS, 1, d).tpot_s for d in range(1, 6)]
    assert ttfts == sorted(ttfts, reverse=True) and tpots == sorted(tpots, reverse=True)
    # 2 req/s of ~600-token prompts at 1000 tokens/s: one prefill worker is over-full
    assert math.isinf(ttfts[0]) and math.isfinite(ttfts[1])


def test_decode_little_law():
    load = Load(1.0, Lengths((10,), (100.0,)))
    p = predict(load, COSTS, 1, 1)
    # b = λ·L·a / (D - λ·L·c) = 100·0.02 / (1 - 0.2) = 2.5; TPOT = a + c·b
    assert p.decode_batch == pytest.approx(2.5)
    assert p.tpot_s == pytest.approx(0.02 + 0.002 * 2.5)
    assert math.isinf(predict(Load(6.0, Lengths((10,), (100.0,))), COSTS, 1, 1).tpot_s)  # 600 tok/s × 2 ms > 1


def test_correction_learns_the_bias_within_bounds():
    load = Load(1.0, Lengths((500,), (100.0,)))
    p = predict(load, COSTS, 1, 1)
    corr = Correction(alpha=0.5)
    for _ in range(20):
        corr.observe(p, measured_ttft_s=2 * p.ttft_s, measured_tpot_s=None)
    assert corr.ttft == pytest.approx(2.0, rel=1e-3) and corr.tpot == 1.0
    assert corr.apply(p).ttft_s == pytest.approx(2 * p.ttft_s, rel=1e-3)
    for _ in range(50):
        corr.observe(p, measured_ttft_s=100 * p.ttft_s, measured_tpot_s=p.tpot_s / 100)
    assert corr.ttft == pytest.approx(4.0, rel=1e-3) and corr.tpot == pytest.approx(0.5, rel=1e-3)


def test_splits_keep_one_of_each():
    assert list(splits(4)) == [(1, 3), (2, 2), (3, 1)]
    assert list(splits(1)) == []
