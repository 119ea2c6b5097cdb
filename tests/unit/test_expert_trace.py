"""Expert routing traces (`--record-expert-trace`): the recorder writes one line per engine step whose counts are
that step's routing (every token's top-k in every sparse layer, nothing from a heartbeat's read or from a call
between steps), and the format's reader round-trips it and refuses what is not a trace."""

from __future__ import annotations

import pytest

from shared.config_fields import from_env
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.sharding.expert_trace import (
    ExpertTrace,
    TraceError,
    TraceHeader,
    TraceStep,
    parse_trace,
    read_trace,
    write_trace,
)
from shared.worker.expert_recorder import ExpertTraceRecorder

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _engine(checkpoint, model) -> Engine:
    config = EngineConfig(
        model=str(checkpoint),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        threads=1,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )
    return Engine.build(config, model=model)


def test_recorder_writes_each_steps_routing_and_ignores_reads_between_steps(checkpoint, model, tmp_path):
    engine = _engine(checkpoint, model)
    path = tmp_path / "sub" / "decode.jsonl"
    recorder = ExpertTraceRecorder(path, engine, "decode", "demo", worker="w1", flush_steps=3)
    recorder.observe(engine)  # AsyncEngine.start's look: the baseline
    for i, n in enumerate((11, 5, 23)):
        engine.add_request(f"r{i}", list(range(7 + 40 * i, 7 + 40 * i + n)), GREEDY)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        recorder.observe(engine)
        steps += 1
        if steps % 2 == 0:  # a heartbeat zeroes the counters between steps (a call: the worker looks again)
            engine.model.take_expert_load()
            recorder.observe(engine)
        if steps == 3:  # a call that routes tokens outside any step: no traffic of the trace
            engine.model.sparse_layers()[next(iter(engine.model.sparse_layers()))].expert_load += 100
            recorder.observe(engine)
    recorder.close()

    (trace,) = read_trace(path)
    h = trace.header
    cfg = engine.model.config
    assert (h.role, h.model, h.worker) == ("decode", "demo", "w1")
    assert h.layers == tuple(engine.model.sparse_layers()) and (h.num_experts, h.top_k) == (
        cfg.num_experts,
        cfg.num_experts_per_tok,
    )
    assert [s.step for s in trace.steps] == list(range(1, steps + 1))
    for s in trace.steps:  # every token of the step went to top_k experts in every sparse layer
        tokens = s.prefill_tokens + s.decode_tokens
        assert tokens > 0 and s.step_s > 0
        assert [sum(c) for c in s.counts] == [tokens * h.top_k] * len(h.layers)
    assert sum(s.prefill_tokens for s in trace.steps) == 11 + 5 + 23
    assert sum(s.decode_tokens for s in trace.steps) == 3 * (GREEDY.max_tokens - 1)
    assert trace.steps[0].prefill_tokens == 16 and trace.steps[-1].decode_tokens == 1  # chunked, then the tail
    assert recorder.steps_recorded == steps


def test_recorder_refuses_a_dense_model(tmp_path):
    from services.demo_model import write_demo_checkpoint

    dense = write_demo_checkpoint(tmp_path / "dense", arch="qwen3", size="tiny")
    engine = Engine.build(EngineConfig(model=str(dense), num_kv_blocks=16, max_model_len=32, threads=1))
    with pytest.raises(ValueError, match="records routed experts"):
        ExpertTraceRecorder(tmp_path / "t.jsonl", engine, "prefill", "dense")


def _trace(role="prefill", steps=2) -> ExpertTrace:
    header = TraceHeader(role=role, model="m", layers=(1, 3), num_experts=4, top_k=2)
    return ExpertTrace(
        header,
        [TraceStep(i, 100.0 + i, 0.01, 4, 0, ((4, 2, 1, 1), (0, 0, 8, 0))) for i in range(steps)],
    )


def test_trace_file_round_trip_segments_and_load(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, _trace("prefill", 2))
    write_trace(path, _trace("decode", 3), append=True)  # a restarted worker appending: a second segment
    first, second = read_trace(path)
    assert (first.role, len(first.steps), second.role, len(second.steps)) == ("prefill", 2, "decode", 3)
    assert first.steps == _trace("prefill", 2).steps
    assert second.load() == {1: [12, 6, 3, 3], 3: [0, 0, 24, 0]}
    # a worker killed mid-line leaves a truncated last line: dropped, the rest reads
    path.write_text(path.read_text() + '{"step": 9, "t": 1')
    assert len(read_trace(path)[1].steps) == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no pdserve-expert-trace header"),
        ('{"step": 1, "t": 0, "counts": []}\n', "a step before any header"),
        ('{"format": "pdserve-expert-trace", "version": 7}\n', "trace version 7"),
        ('{"format": "pdserve-expert-trace", "version": 1, "role": "decode"}\n', "header needs"),
        (
            '{"format": "pdserve-expert-trace", "version": 1, "role": "d", "layers": [1], "num_experts": 2, '
            '"top_k": 1}\n{"step": 1, "t": 0, "counts": [[1, 2, 3]]}\nnot json\n{}\n',
            "the header says 1 layers x 2 experts",
        ),
        (
            '{"format": "pdserve-expert-trace", "version": 1, "role": "d", "layers": [1], "num_experts": 2, '
            '"top_k": 1}\nnot json\n{}\n',
            "not JSON",
        ),
    ],
)
def test_trace_reader_refuses_what_is_not_a_trace(text, message):
    with pytest.raises(TraceError, match=message):
        parse_trace(text)


def test_record_expert_trace_is_a_worker_setting():
    s = from_env(WorkerSettings, {"PDSERVE_RECORD_EXPERT_TRACE": "/tmp/x.jsonl"})
    assert s.record_expert_trace == "/tmp/x.jsonl" and WorkerSettings().record_expert_trace is None


def test_the_worker_switch_records_through_its_engine_observer(checkpoint, model, tmp_path):
    """--record-expert-trace on a worker: the recorder is built with the worker's role and fed by the engine
    thread's observer (Worker._observe, what AsyncEngine calls after every step); off, the worker holds none."""
    from services.mixed.worker import MixedWorker

    engine = _engine(checkpoint, model)
    assert MixedWorker(WorkerSettings(), engine=engine).expert_trace is None
    path = tmp_path / "mixed.jsonl"
    worker = MixedWorker(WorkerSettings(record_expert_trace=str(path), worker_id="w9"), engine=engine)
    recorder = worker.expert_trace
    assert recorder is not None and recorder.header.role == "mixed" and recorder.header.worker == "w9"
    worker._observe(engine)  # what AsyncEngine.start does first
    engine.add_request("r", list(range(3, 20)), GREEDY)
    while engine.has_unfinished():
        engine.step()
        worker._observe(engine)
    recorder.close()
    (trace,) = read_trace(path)
    assert trace.role == "mixed" and len(trace.steps) == recorder.steps_recorded > 0
