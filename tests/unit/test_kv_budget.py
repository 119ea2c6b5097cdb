"""KV memory planning: the planner's arithmetic and refusals (shared/engine/kv_budget.py), the choice of
setting and the CUDA measurement against a fake `torch.cuda` (shared/engine/kv_measure.py), the engine's
start-up line, the settings that reach it, and per-role budgets through `pdserve up`."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.engine import kv_measure
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_budget import (
    CPU_KV_CACHE_BYTES,
    GIB,
    CudaMemory,
    KvShape,
    KvSizing,
    cuda_kv_bytes,
    plan_blocks,
    plan_bytes,
    plan_cuda,
)
from shared.engine.kv_measure import dummy_step, measure_cuda, outside_torch, plan_kv_pool
from shared.engine.kv_pool import KVLayout
from shared.settings import WorkerSettings, from_args, from_env

SHAPE = KvShape(bytes_per_block=8192, block_size=16, max_model_len=2048)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


# ---- the planner --------------------------------------------------------------------------------------


def test_layout_bytes_per_block_is_layers_x_2_x_block_x_heads_x_dim_x_dtype():
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert KVLayout(48, 4, 128, 16, "bfloat16").bytes_per_block == 48 * 2 * 16 * 4 * 128 * 2


def test_bytes_cut_into_whole_blocks():
    plan = plan_bytes(300 * 8192 + 8191, SHAPE)  # a partial block is no block
    assert (plan.num_blocks, plan.tokens, plan.bytes) == (300, 300 * 16, 300 * 8192)
    assert plan.sizing is KvSizing.KV_CACHE_BYTES
    assert plan.max_len_requests == 300 * 16 // 2048 == 2


def test_num_kv_blocks_is_taken_as_it_is():
    plan = plan_blocks(128, SHAPE)
    assert (plan.num_blocks, plan.tokens, plan.max_len_requests, plan.sizing) == (128, 2048, 1, KvSizing.NUM_KV_BLOCKS)


def test_cuda_budget_is_utilization_of_total_minus_weights_activations_and_non_torch():
    memory = CudaMemory(total=80 * GIB, weights=16 * GIB, activation_peak=2 * GIB, non_torch=GIB, free=60 * GIB)
    assert cuda_kv_bytes(memory, 0.9) == int(72 * GIB) - 19 * GIB
    plan = plan_cuda(memory, 0.9, KvShape(bytes_per_block=GIB // 1024, block_size=16, max_model_len=4096))
    assert plan.num_blocks == 53 * 1024 and plan.sizing is KvSizing.GPU_MEMORY_UTILIZATION
    assert "gpu_memory_utilization 0.9 x 80.00 GiB - weights 16.00 GiB" in plan.budget
    assert plan_cuda(memory, 0.5, KvShape(GIB // 1024, 16, 4096)).num_blocks == (40 - 19) * 1024


def test_cuda_budget_never_exceeds_the_free_memory_other_processes_leave():
    # another engine holds 40 GiB of the device: this one's 0.9 share (53 GiB for KV) does not fit in what is free
    memory = CudaMemory(total=80 * GIB, weights=16 * GIB, activation_peak=2 * GIB, non_torch=GIB, free=20 * GIB)
    plan = plan_cuda(memory, 0.9, KvShape(bytes_per_block=GIB // 1024, block_size=16, max_model_len=4096))
    assert plan.num_blocks == 20 * 1024
    assert "capped by the device's free 20.00 GiB" in plan.budget


@pytest.mark.parametrize(
    ("plan", "remedy"),
    [
        (lambda: plan_blocks(127, SHAPE), "raise num_kv_blocks or lower max_model_len"),
        (lambda: plan_bytes(128 * 8192 - 1, SHAPE), "raise kv_cache_bytes (PDSERVE_KV_CACHE_BYTES) or lower"),
        (lambda: plan_bytes(100, SHAPE), "raise kv_cache_bytes"),  # not even one block
        (
            # weights + activations > 90 %
            lambda: plan_cuda(CudaMemory(10 * GIB, 9 * GIB, GIB, 0, free=GIB), 0.9, SHAPE),
            "raise gpu_memory_utilization (PDSERVE_GPU_MEMORY_UTILIZATION), free the device, lower "
            "max_num_batched_tokens",
        ),
    ],
)
def test_a_plan_without_room_for_one_max_length_request_is_refused_with_what_to_change(plan, remedy):
    with pytest.raises(ValueError, match="less than one request of max_model_len 2048") as err:
        plan()
    assert remedy in str(err.value) and "lower max_model_len" in str(err.value)


def test_exactly_one_max_length_request_is_enough():
    assert plan_bytes(128 * 8192, SHAPE).max_len_requests == 1


def test_summary_says_blocks_tokens_bytes_and_requests():
    line = plan_bytes(256 << 20, SHAPE).summary()
    assert line == (
        "KV cache: 32768 blocks x 16 tokens = 524288 tokens, 256.0 MiB (kv_cache_bytes 256.0 MiB); "
        "holds 256 requests of max_model_len 2048"
    )


# ---- which setting, and the CUDA measurement --------------------------------------------------------------


class FakeCuda:
    """A device allocator in numbers: what torch.cuda would report, with allocations the test scripts."""

    def __init__(self, total: int, non_torch: int, allocated: int) -> None:
        self.total, self.non_torch = total, non_torch
        self.allocated = self.peak = self.reserved = allocated
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def synchronize(self, device) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset")
        self.peak = self.allocated

    def memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        return self.peak

    def memory_reserved(self, device) -> int:
        return self.reserved

    def mem_get_info(self, device) -> tuple[int, int]:
        return self.total - self.reserved - self.non_torch, self.total


class Scratch:
    """A step's inputs: allocated when made, freed when the last reference goes."""

    def __init__(self, cuda: FakeCuda, n: int) -> None:
        self.cuda, self.n = cuda, n
        cuda.alloc(n)

    def __del__(self) -> None:
        self.cuda.free(self.n)


def scripted_step(cuda: FakeCuda, scratch: int, activations: int):
    """prepare() for measure_cuda: a scratch allocation, then a step whose activations peak and are freed."""

    def prepare():
        inputs = Scratch(cuda, scratch)

        def step() -> None:
            assert inputs.n == scratch
            assert cuda.calls[-1] == "reset", "the peak must be reset after the inputs, right before the step"
            cuda.alloc(activations)
            cuda.free(activations)

        return step

    return prepare


def test_measure_cuda_counts_weights_activation_peak_and_non_torch_but_not_the_step_inputs():
    cuda = FakeCuda(total=80 * GIB, non_torch=GIB // 2, allocated=16 * GIB)  # the weights are loaded
    memory = measure_cuda(cuda, torch.device("cuda"), scripted_step(cuda, scratch=3 * GIB, activations=2 * GIB))
    free = 80 * GIB - 16 * GIB - GIB // 2
    assert memory == CudaMemory(80 * GIB, weights=16 * GIB, activation_peak=2 * GIB, non_torch=GIB // 2, free=free)
    assert cuda.allocated == 16 * GIB  # the scratch was freed before the device was read


def test_non_torch_memory_present_when_the_engine_started_is_not_charged_to_it():
    # 30 GiB outside this process's allocator before it loaded anything (the CUDA context, another engine);
    # 1 GiB more appears by the time it plans (its own NCCL and cuBLAS buffers): only that is its own
    cuda = FakeCuda(total=80 * GIB, non_torch=30 * GIB, allocated=0)
    at_start = outside_torch(cuda, torch.device("cuda"))
    cuda.alloc(16 * GIB)  # the weights
    cuda.non_torch += GIB
    memory = measure_cuda(cuda, torch.device("cuda"), scripted_step(cuda, scratch=GIB, activations=GIB), at_start)
    assert (at_start, memory.non_torch, memory.free) == (30 * GIB, GIB, 80 * GIB - 16 * GIB - 31 * GIB)


def config(**kw) -> EngineConfig:
    return EngineConfig(model="unused", **kw)


class NoCuda:
    def __getattr__(self, name: str):
        raise AssertionError(f"torch.cuda.{name} called: this plan must not measure the device")


def test_num_kv_blocks_wins_over_every_budget_and_measures_nothing():
    c = config(device="cuda", num_kv_blocks=200, kv_cache_bytes=1 << 30, gpu_memory_utilization=0.5)
    plan = plan_kv_pool(c, LAYOUT, 256, model=None, cuda=NoCuda())  # type: ignore[arg-type]
    assert (plan.num_blocks, plan.sizing) == (200, KvSizing.NUM_KV_BLOCKS)


def test_kv_cache_bytes_wins_over_gpu_memory_utilization_on_cuda():
    c = config(device="cuda:1", kv_cache_bytes=100 * LAYOUT.bytes_per_block)
    plan = plan_kv_pool(c, LAYOUT, 256, model=None, cuda=NoCuda())  # type: ignore[arg-type]
    assert (plan.num_blocks, plan.sizing) == (100, KvSizing.KV_CACHE_BYTES)


def test_cpu_default_is_a_fixed_budget():
    assert EngineConfig(model="m").kv_cache_bytes is None and CPU_KV_CACHE_BYTES == 256 << 20
    plan = plan_kv_pool(config(), LAYOUT, 256, model=None, cuda=NoCuda())  # type: ignore[arg-type]
    assert (plan.bytes, plan.sizing) == (CPU_KV_CACHE_BYTES, KvSizing.KV_CACHE_BYTES)


def test_cuda_without_a_budget_profiles_the_worst_step(monkeypatch):
    cuda = FakeCuda(total=40 * GIB, non_torch=GIB, allocated=10 * GIB)
    asked = []

    def fake_dummy_step(model, layout, device, num_tokens, context_len, num_logits):
        asked.append((device, num_tokens, context_len, num_logits))
        return scripted_step(cuda, scratch=GIB, activations=5 * GIB)()

    monkeypatch.setattr(kv_measure, "dummy_step", fake_dummy_step)
    c = config(device="cuda", gpu_memory_utilization=0.5, scheduler=SchedulerConfig(max_num_seqs=8))
    plan = plan_kv_pool(c, LAYOUT, 4096, model=None, cuda=cuda)  # type: ignore[arg-type]
    # the most tokens a step runs (max_num_batched_tokens 512), at the end of the longest context
    assert asked == [(torch.device("cuda"), 512, 4096, 8)]
    assert plan.sizing is KvSizing.GPU_MEMORY_UTILIZATION
    assert plan.bytes == (20 - 10 - 5 - 1) * GIB  # 0.5 x 40 - weights - activations - non-torch
    assert plan.num_blocks == 4 * GIB // LAYOUT.bytes_per_block


def test_dummy_step_runs_the_model_over_a_chunk_at_the_end_of_a_context(model_dir):
    """On CPU here (on a GPU it runs the same code): the scratch pool, metadata and positions fit the model."""
    engine = Engine.from_dir(model_dir, num_kv_blocks=64, max_model_len=256)
    for num_tokens, context_len in ((32, 100), (64, 64)):  # a later chunk (masked) and a first one (causal)
        dummy_step(engine.model, engine.layout, torch.device("cpu"), num_tokens, context_len, 4)()
    assert all(int(load.sum()) == 0 for load in engine.model.take_expert_load().values())


# ---- the engine and its settings ----------------------------------------------------------------------------


def test_engine_logs_one_kv_line_at_start(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="shared.engine"):
        engine = Engine.from_dir(model_dir, num_kv_blocks=40, max_model_len=300)
    [line] = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    bytes_ = 40 * engine.layout.bytes_per_block
    assert line.startswith(f"KV cache: 40 blocks x 16 tokens = 640 tokens, {bytes_ / (1 << 20):.1f} MiB")
    assert line.endswith("holds 2 requests of max_model_len 300")
    assert engine.pool.num_blocks == engine.blocks.num_blocks == 40


def test_engine_on_cpu_cuts_the_default_budget(model_dir):
    engine = Engine.from_dir(model_dir, max_model_len=256)
    assert engine.pool.num_blocks == CPU_KV_CACHE_BYTES // engine.layout.bytes_per_block
    assert engine.pool.tensor.nbytes == engine.kv_plan.bytes


def test_engine_refuses_a_pool_too_small_for_one_max_length_request(model_dir):
    with pytest.raises(ValueError, match="holds 48 tokens .* less than one request of max_model_len 64: raise num"):
        Engine.from_dir(model_dir, num_kv_blocks=3, max_model_len=64)
    with pytest.raises(ValueError, match="less than one request of max_model_len 2048: raise kv_cache_bytes"):
        Engine.from_dir(model_dir, kv_cache_bytes=1 << 19)  # 1024 tokens of the tiny model


@pytest.mark.parametrize(
    "bad", [dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5), dict(kv_cache_bytes=0)]
)
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(model="m", **bad)


def test_gpu_memory_utilization_is_a_setting_with_env_and_flag(monkeypatch):
    env = {"PDSERVE_GPU_MEMORY_UTILIZATION": "0.75", "PDSERVE_KV_CACHE_BYTES": ""}
    engine = from_env(WorkerSettings, env).engine
    assert (engine.gpu_memory_utilization, engine.kv_cache_bytes) == (0.75, None)
    assert from_env(WorkerSettings, {}, gpu_memory_utilization="0.5").engine.gpu_memory_utilization == 0.5
    assert from_env(WorkerSettings, {}).engine.gpu_memory_utilization == 0.9


def test_pdserve_up_gives_each_role_its_own_budget(monkeypatch, tmp_path):
    """`pdserve up --decode-args=...`: the decode workers' command lines carry the flags, and those parse into
    that role's settings; the prefill workers keep the default."""
    import services.cli as cli
    import services.local.supervisor as supervisor

    stacks = []

    class FakeSupervisor:
        def __init__(self, stack, *args, **kwargs) -> None:
            stacks.append(stack)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", FakeSupervisor)
    monkeypatch.setattr("services.local.preflight.preflight", lambda *_a, **_kw: None)  # no checkpoint here
    argv = ["up", "--model", str(tmp_path), "--decode-args=--kv-cache-bytes 2147483648 --gpu-memory-utilization 0.95"]
    assert cli.main([*argv, "--prefill-args=--kv-cache-bytes=1048576"]) == 0
    [stack] = stacks
    worker: list = []
    monkeypatch.setattr(cli, "_worker", worker.append)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    for role in ("prefill", "decode"):
        cli.main([role, *stack._worker_flags(role)])
    prefill, decode = (from_args(WorkerSettings, a).engine for a in worker)
    assert (prefill.kv_cache_bytes, prefill.gpu_memory_utilization) == (1 << 20, 0.9)
    assert (decode.kv_cache_bytes, decode.gpu_memory_utilization) == (2 << 30, 0.95)
