"""Heartbeats and gauges of a worker whose model has several KV cache groups (gpt-oss: full layers and a
sliding-window group, shared/engine/kv_groups.py): every group's free and total blocks travel in the beat and
are exposed as gauges labelled by group, while the fields the gateway reads (`free_blocks`, `total_blocks`, the
capacity it admits by) keep meaning group 0. A one-group model reports its one group."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.demo_model import GPT_OSS_WINDOW, write_demo_checkpoint
from services.mixed.worker import MixedWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.messages import Heartbeat, decode, encode
from shared.settings import WorkerSettings
from shared.worker.engine_load import EngineLoad

BLOCK = 4
PROMPT = list(range(3, 103))  # 100 tokens: far past the tiny gpt-oss window of 16


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("gpt-oss-beats") / "hybrid", arch="gpt_oss", size="tiny")


def _worker(checkpoint) -> MixedWorker:
    config = EngineConfig(
        str(checkpoint),
        max_model_len=256,
        num_kv_blocks=64,
        block_size=BLOCK,
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
    )
    return MixedWorker(WorkerSettings(engine=config, worker_id="beats", metrics_port=None), engine=Engine.build(config))


def _gauge(name: str, worker: MixedWorker, group: int) -> float | None:
    labels = {"model_name": worker.model_name, "role": str(worker.role), "group": str(group)}
    return REGISTRY.get_sample_value(f"pdserve:{name}", labels)


def test_a_hybrid_worker_reports_every_kv_cache_group(hybrid_dir):
    worker = _worker(hybrid_dir)
    engine = worker.engine.engine
    assert [g.window for g in engine.kv_groups] == [None, GPT_OSS_WINDOW]
    totals = tuple(b.num_blocks for b in engine.group_blocks)

    idle = worker.heartbeat()
    assert idle.kv_group_total_blocks == totals and idle.kv_group_free_blocks == totals
    assert (idle.free_blocks, idle.total_blocks) == (totals[0], totals[0])  # group 0, as the gateway reads it

    # a long request part way through its decode: the full group holds a block per 4 tokens of the sequence,
    # the window group only the window's (the blocks behind it are freed)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while engine.requests["r"].num_tokens < len(PROMPT) + 20:
        engine.step()
    worker.load = EngineLoad.of(engine)  # what the engine thread publishes after a step
    beat = worker.heartbeat()
    used = [t - f for f, t in zip(beat.kv_group_free_blocks, beat.kv_group_total_blocks, strict=True)]
    assert used == [totals[g] - b.num_free for g, b in enumerate(engine.group_blocks)]
    assert used[0] == -(-engine.requests["r"].num_computed_tokens // BLOCK) and 0 < used[1] < used[0] // 2
    assert (beat.free_blocks, beat.total_blocks) == (beat.kv_group_free_blocks[0], totals[0])

    for group in (0, 1):  # the gauges say the same, labelled by group
        assert _gauge("kv_cache_group_free_blocks", worker, group) == beat.kv_group_free_blocks[group]
        assert _gauge("kv_cache_group_num_blocks", worker, group) == totals[group]
        assert _gauge("kv_cache_group_usage_perc", worker, group) == pytest.approx(used[group] / totals[group])
    assert _gauge("kv_cache_group_free_blocks", worker, 2) is None  # no third group

    assert decode(encode(beat), Heartbeat) == beat  # the wire keeps them


def test_a_one_group_model_reports_its_one_group_and_old_beats_still_decode(model_dir):
    load = EngineLoad.of(Engine.from_dir(model_dir, max_model_len=256, num_kv_blocks=32))
    assert (load.group_free_blocks, load.group_total_blocks) == ((32,), (32,)) and load.group_usage() == (0.0,)
    old = b'{"worker_id": "w", "role": "decode", "model": "demo", "rpc_address": null, "free_blocks": 3}'
    beat = decode(old, Heartbeat)  # a worker that predates the per-group fields
    assert beat.free_blocks == 3 and beat.kv_group_free_blocks == () and beat.kv_group_total_blocks == ()
