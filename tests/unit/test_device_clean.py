"""Device placement without a GPU: every architecture runs engine steps (prefill chunks, a later chunk beside
decodes, decodes) with its weights, buffers, KV pool and inputs on the `meta` device under `DeviceGuard`
(tests/device_guard.py), which fails on any op that mixes devices, any host sync, and anything the host
prepares inside the model's forward. What crosses per step is pinned down: the sampled ids, one copy.

The second half reintroduces known device mistakes and asserts the guard catches each one.
"""

from __future__ import annotations

import pytest
import torch

from services.cli import main
from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model import moe as moe_module
from shared.model.config import ARCHITECTURES
from shared.model.device import resolve_device
from shared.model.paged_attention import AttentionMetadata
from tests.device_guard import DeviceGuard, DeviceMisplacement

META = torch.device("meta")
BUDGET = 24  # tokens per step: the 39-token prompt needs two chunks
SHORT, LONG = list(range(1, 6)), list(range(1, 40))
# Which requests sample at each step: short prefill + long chunk 1; short decode + long chunk 2 (a later
# chunk, with its mask, beside a decode); both decode.
EXPECTED_SAMPLERS = [{"short"}, {"short", "long"}, {"short", "long"}]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), arch="qwen2_moe", size="tiny")


def meta_engine(checkpoint) -> Engine:
    return Engine.from_dir(
        checkpoint,
        device="meta",
        num_kv_blocks=16,
        max_model_len=128,
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET),
    )


def run_steps(engine: Engine, guard: DeviceGuard) -> None:
    """Three engine steps under the guard; each step's only read-back must be its sampled ids."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("short", SHORT, params)
    engine.add_request("long", LONG, params)
    guard.watch(engine.model)
    with guard:
        for expected in EXPECTED_SAMPLERS:
            guard.readbacks.clear()
            sampled = {o.request_id for o in engine.step()}
            assert sampled == expected
            only_ids = [((len(expected),), torch.int64)]
            assert guard.readbacks == only_ids, f"read back {guard.readbacks}; expected only the sampled ids"


def test_engine_steps_stay_on_the_device(checkpoint):
    engine = meta_engine(checkpoint)
    placed = [*engine.model.parameters(), *engine.model.buffers(), engine.pool.tensor]
    assert {t.device for t in placed} == {META}
    guard = DeviceGuard(META)
    run_steps(engine, guard)
    assert guard.h2d > 0  # the step's inputs and metadata did cross, outside the forward
    moes = engine.model.sparse_layers()
    guard.readbacks.clear()
    with guard:
        load = engine.model.take_expert_load()
    assert sorted(load) == sorted(moes)
    assert guard.readbacks == ([((len(moes), engine.model.config.num_experts), torch.int64)] if moes else [])
    assert all(t.device.type == "cpu" for t in load.values())


# ---- the guard catches each known mistake ---------------------------------------------------------------


def _rope_tables_on_host(engine, monkeypatch):
    rotary = engine.model.rotary
    rotary.cos, rotary.sin = torch.zeros(rotary.cos.shape), torch.zeros(rotary.sin.shape)


def _expert_counter_on_host(engine, monkeypatch):
    moe = next(iter(engine.model.sparse_layers().values()))
    moe.expert_load = torch.zeros(moe.expert_load.shape, dtype=torch.int64)


def _moe_reads_counts_on_host(engine, monkeypatch):
    def grouped(self, x, ids, weights, counts):
        return self.forward_grouped(x, ids, weights, counts.tolist())

    monkeypatch.setattr(moe_module.Experts, "forward", grouped)


def _metadata_left_on_host(engine, monkeypatch):
    build = AttentionMetadata.build.__func__

    def on_host(cls, *args, device=None, **kwargs):
        return build(cls, *args, device="cpu", **kwargs)

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(on_host))


def _sampling_on_host(engine, monkeypatch):
    sample = engine.runner.sampler.sample_with_logprobs
    monkeypatch.setattr(engine.runner.sampler, "sample_with_logprobs", lambda logits, *a: sample(logits.cpu(), *a))


def _arange_in_forward(engine, monkeypatch):
    tables = engine.model.rotary.tables

    def with_host_arange(positions, dtype):
        return tables(positions + 0 * torch.arange(1), dtype)

    monkeypatch.setattr(engine.model.rotary, "tables", with_host_arange)


MISTAKES = {
    "rope tables on the host": (_rope_tables_on_host, "mixes devices"),
    "expert counter on the host": (_expert_counter_on_host, "creates a host tensor"),
    "MoE reads its counts per layer": (_moe_reads_counts_on_host, "inside the forward"),
    "metadata left on the host": (_metadata_left_on_host, "mixes devices"),
    "a host tensor made in the forward": (_arange_in_forward, "creates a host tensor"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_guard_catches_a_device_mistake(moe_checkpoint, monkeypatch, mistake):
    engine = meta_engine(moe_checkpoint)
    make_mistake, message = MISTAKES[mistake]
    make_mistake(engine, monkeypatch)
    with pytest.raises(DeviceMisplacement, match=message):
        run_steps(engine, DeviceGuard(META))


def test_guard_catches_logits_read_back_for_sampling(moe_checkpoint, monkeypatch):
    engine = meta_engine(moe_checkpoint)
    _sampling_on_host(engine, monkeypatch)
    with pytest.raises(AssertionError, match="expected only the sampled ids"):
        run_steps(engine, DeviceGuard(META))


def test_penalties_filters_and_logprobs_stay_on_the_device(moe_checkpoint):
    """Bias, penalties and top-k logprobs run on the device: each step still reads back one copy, the sampled ids
    with the logprobs' k values and ids (float64). Greedy: the meta device has no generators to draw with."""
    engine = meta_engine(moe_checkpoint)
    k = 3
    params = SamplingParams(
        max_tokens=8, temperature=0.0, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((2, 1.0),), logprobs=k, ignore_eos=True,
    )  # fmt: skip
    engine.add_request("short", SHORT, params)
    engine.add_request("long", LONG, params)
    guard = DeviceGuard(META)
    guard.watch(engine.model)
    with guard:
        for expected in EXPECTED_SAMPLERS:
            guard.readbacks.clear()
            assert {o.request_id for o in engine.step()} == expected
            n = len(expected)
            assert guard.readbacks == [((n + n + 2 * n * k,), torch.float64)], guard.readbacks


# ---- the device setting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu", "cuda0", "tpu", "cuda:x", ""])
def test_engine_config_refuses_an_unknown_device(name):
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="m", device=name)


@pytest.mark.parametrize("name", ["xpu", "mps", "vulkan"])
def test_resolve_device_refuses_unsupported_kinds(name):
    with pytest.raises(ValueError, match="choose cpu, cuda or cuda:N"):
        resolve_device(name)


def test_resolve_device_names_cpu_and_meta():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("meta") == META


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_generate_refuses_cuda_without_cuda(moe_checkpoint, capsys, name):
    assert main(["generate", "hi", "--model", str(moe_checkpoint), "--device", name, "--max-tokens", "2"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_generate_runs_on_the_named_device(moe_checkpoint, capsys):
    assert (
        main(["generate", "hi", "--model", str(moe_checkpoint), "--device", "cpu", "--max-tokens", "2", "--json"]) == 0
    )
    assert '"finish_reason": "length"' in capsys.readouterr().out
