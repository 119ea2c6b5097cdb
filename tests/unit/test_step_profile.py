"""benchmarks/step_profile.py at a tiny size: the JSON it writes, and its phases adding up to the step; and the
engine's StepClock hook (shared/engine/step_clock.py) stamping every phase of a step."""

from __future__ import annotations

import json

import pytest

from benchmarks import step_profile
from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.engine.step_clock import HOST_PHASES, PHASES, StepClock

ENGINE_PHASES = ("schedule", "inputs", "metadata", "model", "sample", "update")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("step_profile") / "m", arch="qwen3_moe", size="tiny")


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_step_profile_writes_phases_that_add_up_to_the_step(tiny, tmp_path, driver):
    out = tmp_path / "profile.json"
    argv = ["--model", str(tiny), "--batches", "1,3", "--steps", "2", "--threads", "1", "--driver", driver]
    step_profile.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["driver"] == driver and cfg["steps"] == 2 and cfg["phases"] == list(PHASES)
    assert {"cpu", "threads", "load_before", "load_after"} <= set(cfg)
    assert [r["batch"] for r in report["batches"]] == [1, 3]
    for row in report["batches"]:
        assert row["steps"] == 2  # the prefill step is left out: only steps that decode every sequence count
        expected = ENGINE_PHASES + (("stream_out",) if driver == "async" else ())
        assert set(row["phases"]) == set(expected)
        for sample in row["samples_ms"]:
            assert set(sample) == set(expected) and all(v >= 0 for v in sample.values())
        means = row["mean_ms"]
        assert row["host_ms"] > 0 and 0 < row["host_share"] < 1
        assert row["model_ms"] == pytest.approx(row["median_ms"]["model"])
        assert sum(means.values()) == pytest.approx(
            sum(sum(s.values()) for s in row["samples_ms"]) / len(row["samples_ms"])
        )
        if driver == "sync":  # timed around engine.step(): the stamps cover all but the call itself
            assert row["wall_ms"] >= row["step_ms"] * 0.999
            assert row["step_ms"] >= 0.5 * row["wall_ms"]


def test_engine_stamps_each_phase_once_per_step_and_nothing_without_a_clock(checkpoint):
    engine = Engine.from_dir(
        checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=64), num_kv_blocks=16, max_model_len=64
    )
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, unstamped
    clock = StepClock()
    engine.time_steps(clock)
    engine.step()
    engine.time_steps(None)
    engine.step()
    assert len(clock.steps) == 1
    (step,) = clock.steps
    assert (step.seqs, step.tokens, step.decode_only) == (1, 1, True)
    assert tuple(step.phases) == ENGINE_PHASES  # in the order the step runs them
    assert step.total == pytest.approx(sum(step.phases.values()))
    assert set(HOST_PHASES) == set(PHASES) - {"model"}
