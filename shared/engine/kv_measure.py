"""The device side of KV sizing: which setting applies, and on CUDA, measuring the device around a dummy
worst-case step. The arithmetic is shared/engine/kv_budget.py's; this module only gathers its numbers.

The profiled step is one prefill chunk of max_num_batched_tokens tokens (at most max_model_len) at the end of
a max_model_len context: the most query tokens a step runs, attending over the longest context one can have
(the torch attention path's gathered context and scores grow with both), plus the logits of up to
max_num_seqs sampling sequences. Not covered: the torch decode path's gather of every decoding sequence's
whole context (Bd × context); the Triton decode kernel, which CUDA is meant to run, gathers nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from shared.engine.config import EngineConfig
from shared.engine.kv_budget import CPU_KV_CACHE_BYTES, CudaMemory, KvPlan, KvShape, plan_blocks, plan_bytes, plan_cuda
from shared.engine.kv_pool import KVLayout, KVPool
from shared.model.paged_attention import AttentionMetadata
from shared.model.transformer import CausalLM


class CudaApi(Protocol):
    """The part of `torch.cuda` the measurement uses (tests pass a fake)."""

    def synchronize(self, device: torch.device) -> None: ...
    def empty_cache(self) -> None: ...
    def reset_peak_memory_stats(self, device: torch.device) -> None: ...
    def memory_allocated(self, device: torch.device) -> int: ...
    def max_memory_allocated(self, device: torch.device) -> int: ...
    def memory_reserved(self, device: torch.device) -> int: ...
    def mem_get_info(self, device: torch.device) -> tuple[int, int]: ...


def plan_kv_pool(
    config: EngineConfig,
    layout: KVLayout,
    max_model_len: int,
    model: CausalLM,
    cuda: CudaApi = torch.cuda,
    non_torch_at_start: int = 0,
) -> KvPlan:
    """The pool's plan for an engine whose model is loaded (num_kv_blocks, else kv_cache_bytes, else on CUDA a
    profiled step). On CUDA without either setting it runs one dummy forward pass (device memory allocated
    and freed, peak-memory statistics reset). `non_torch_at_start`: `outside_torch(cuda, device)` before the
    engine loaded anything (memory of the CUDA context and of other processes, not charged to this engine).
    ValueError when the plan holds no max_model_len request."""
    shape = KvShape(layout.bytes_per_block, layout.block_size, max_model_len)
    device = torch.device(config.device)
    if config.num_kv_blocks is not None:
        return plan_blocks(config.num_kv_blocks, shape)
    if config.kv_cache_bytes is not None or device.type != "cuda":
        return plan_bytes(config.kv_cache_bytes or CPU_KV_CACHE_BYTES, shape)
    sched = config.scheduler
    num_tokens = min(sched.max_num_batched_tokens, max_model_len)

    def prepare() -> Callable[[], None]:
        return dummy_step(model, layout, device, num_tokens, max_model_len, min(sched.max_num_seqs, num_tokens))

    memory = measure_cuda(cuda, device, prepare, non_torch_at_start)
    return plan_cuda(memory, config.gpu_memory_utilization, shape)


def outside_torch(cuda: CudaApi, device: torch.device) -> int:
    """Memory in use on `device` outside this process's torch allocator: the CUDA context, other libraries'
    buffers, and every other process on the device."""
    free, total = cuda.mem_get_info(device)
    return max(total - free - cuda.memory_reserved(device), 0)


def measure_cuda(
    cuda: CudaApi, device: torch.device, prepare: Callable[[], Callable[[], None]], non_torch_at_start: int = 0
) -> CudaMemory:
    """`prepare()` allocates a step's inputs (counted as neither weights nor activations) and returns the step;
    the step runs once with peak statistics reset. Then the allocator's cache is emptied and the device's
    free memory read; non-torch memory is counted from `non_torch_at_start` (see plan_kv_pool). Side effects:
    resets `device`'s peak-memory statistics, empties the cache."""
    cuda.synchronize(device)
    cuda.empty_cache()
    weights = cuda.memory_allocated(device)
    step = prepare()
    cuda.synchronize(device)
    cuda.reset_peak_memory_stats(device)
    before = cuda.memory_allocated(device)
    step()
    cuda.synchronize(device)
    peak = cuda.max_memory_allocated(device) - before
    del step  # frees the step's inputs before the device is read
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    non_torch = max(outside_torch(cuda, device) - non_torch_at_start, 0)
    return CudaMemory(total=total, weights=weights, activation_peak=peak, non_torch=non_torch, free=free)


def dummy_step(
    model: CausalLM, layout: KVLayout, device: torch.device, num_tokens: int, context_len: int, num_logits: int
) -> Callable[[], None]:
    """Allocates a scratch pool holding `context_len` tokens and returns a step that runs the model over the
    last `num_tokens` of them (token id 0 throughout), then the logits of `num_logits` rows, and drops the
    expert-load counts it made. Any device."""
    num_blocks = -(-context_len // layout.block_size)
    pool = KVPool(layout, num_blocks, device)
    meta = AttentionMetadata.build(
        [list(range(num_blocks))],
        [context_len],
        [num_tokens],
        layout.block_size,
        device,
        model.kernels,
        windows=model.config.windows,
        cpu_decode_kernel=model.cpu_attention,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(context_len - num_tokens, context_len, device=device)

    @torch.inference_mode()
    def step() -> None:
        hidden = model(ids, positions, pool.layer_caches(), meta)
        model.logits(hidden[-num_logits:])
        model.take_expert_load()  # the dummy's routing is no traffic: keep it out of the expert-load metrics

    return step
