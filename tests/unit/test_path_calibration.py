"""A worker's live cost coefficients (shared/worker/calibration.py over shared/worker/ewma.py): the moving averages,
the fitted lines, the step and pull samples, and a real worker's heartbeat carrying what its engine's steps
measured."""

from __future__ import annotations

import pytest

from services.mixed.worker import MixedWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine, EngineStats
from shared.engine.sampling import SamplingParams
from shared.messages import Heartbeat, decode, encode
from shared.settings import WorkerSettings
from shared.worker.calibration import PullCalibration, StepCalibration
from shared.worker.ewma import Ewma, EwmaLine, Line

# ---- moving averages ------------------------------------------------------------------------------------------


def test_an_ewma_starts_at_its_first_sample_and_forgets_geometrically():
    mean = Ewma(0.5)
    assert mean.value is None
    assert mean.add(4.0) == 4.0
    assert mean.add(8.0) == 6.0 and mean.add(8.0) == 7.0
    with pytest.raises(ValueError):
        Ewma(0.0)


def test_a_line_is_recovered_from_exact_samples():
    line = EwmaLine(0.2)
    assert line.fit() is None
    for x in (16, 512, 64, 1024, 128, 32) * 3:
        line.add(x, 0.005 + 0.001 * x)  # 5 ms a step + 1 ms a token
    fit = line.fit()
    assert fit is not None
    assert fit.intercept == pytest.approx(0.005) and fit.slope == pytest.approx(0.001)


def test_samples_of_one_size_give_the_line_through_the_origin():
    line = EwmaLine(0.2)
    for _ in range(5):
        line.add(100, 0.2)
    assert line.fit() == Line(0.0, pytest.approx(0.002))


def test_an_unphysical_fit_falls_back_to_the_line_through_the_origin():
    line = EwmaLine(0.5)
    line.add(100, 0.30)  # the bigger sample was the faster: a negative slope
    line.add(200, 0.10)
    fit = line.fit()
    assert fit is not None and fit.intercept == 0.0 and fit.slope > 0
    with pytest.raises(ValueError):
        line.add(0, 1.0)


def test_the_line_follows_a_change_in_cost():
    line = EwmaLine(0.2)
    for x in (100, 200) * 10:
        line.add(x, 0.001 * x)
    for x in (100, 200) * 15:  # twice as slow now
        line.add(x, 0.002 * x)
    fit = line.fit()
    assert fit is not None and fit.slope == pytest.approx(0.002, rel=0.05)


# ---- step and pull samples ------------------------------------------------------------------------------------


def _after(stats: EngineStats, steps: int = 1, prefill: int = 0, decode: int = 0, seconds: float = 0.0) -> EngineStats:
    return EngineStats(stats.prefill_tokens + prefill, stats.decode_tokens + decode, 0, stats.steps + steps,
                       stats.step_s + seconds)  # fmt: skip


def test_each_step_is_a_sample_of_its_phase():
    calibration = StepCalibration(alpha=0.5)
    stats = EngineStats()
    calibration.observe(stats)
    assert calibration.costs.prefill_tokens_per_s is None and calibration.costs.decode_step_ms is None
    for tokens in (100, 400, 100, 400):  # prefill steps: 4 ms + 0.5 ms a token
        stats = _after(stats, prefill=tokens, seconds=0.004 + 0.0005 * tokens)
        calibration.observe(stats)
    calibration.observe(stats)  # a command between steps: nothing moved, no sample
    stats = _after(stats, decode=8, seconds=0.012)  # a decode-only step of 8
    calibration.observe(stats)
    costs = calibration.costs
    assert costs.prefill_tokens_per_s == pytest.approx(2000.0)
    assert costs.prefill_step_ms == pytest.approx(4.0)
    assert costs.decode_step_ms == pytest.approx(12.0)
    stats = _after(stats, steps=2, decode=16, seconds=1.0)  # two steps in one delta: not attributable
    calibration.observe(stats)
    assert calibration.costs.decode_step_ms == pytest.approx(12.0)


def test_pulls_fit_a_cost_per_mb_and_a_fixed_cost():
    pulls = PullCalibration(alpha=0.5)
    assert pulls.fitted() == (None, None)
    for mb in (1, 8, 2, 32, 1, 8):
        pulls.observe(int(mb * 1e6), 0.002 + 0.0006 * mb)
    per_mb, overhead = pulls.fitted()
    assert per_mb == pytest.approx(0.6) and overhead == pytest.approx(2.0)


# ---- a worker's heartbeat -------------------------------------------------------------------------------------


def test_a_workers_heartbeat_carries_what_its_engine_steps_measured(model_dir):
    config = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    engine = Engine.build(config)
    worker = MixedWorker(WorkerSettings(engine=config, worker_id="w1", metrics_port=None), engine=engine)
    fresh = worker.heartbeat().path_calibration
    assert fresh is not None and fresh.prefill_tokens_per_s is None and fresh.decode_step_ms is None
    assert fresh.kv_bytes_per_token == engine.layout.bytes_per_token > 0
    for i, prompt_len in enumerate((8, 40, 20)):
        engine.add_request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
            worker._observe(engine)  # what the engine thread does after every step
    engine.add_request("queued", list(range(3, 33)), SamplingParams(max_tokens=1))
    worker._observe(engine)
    beat = decode(encode(worker.heartbeat()), Heartbeat)  # as the gateway reads it
    c = beat.path_calibration
    assert c is not None
    assert c.prefill_tokens_per_s is not None and c.prefill_tokens_per_s > 0
    assert c.decode_step_ms is not None and c.decode_step_ms > 0
    assert beat.waiting_tokens == 30  # the engine's queue: the heartbeat's own field, read by routing and path
    assert c.kv_transfer_ms_per_mb is None  # no pull yet: a mixed worker never pulls
