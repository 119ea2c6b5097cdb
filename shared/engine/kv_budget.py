"""How many KV blocks an engine's pool gets: pure arithmetic on numbers (no torch, no device), so every rule
is unit-tested on any machine. shared/engine/kv_measure.py measures a CUDA device and feeds this module.

Three sources, the first that applies wins:
  1. `num_kv_blocks` (tests): that many blocks.
  2. `kv_cache_bytes`: that budget cut into blocks; on a device other than CUDA it defaults to CPU_KV_CACHE_BYTES.
  3. on CUDA without either: `gpu_memory_utilization` × the device's total memory, minus what this engine's
     weights, a profiled worst-case step's activations and its own memory outside torch's allocator take
     (vLLM's meaning: other processes on the device are not charged to this engine's share), and never more
     than the device has free.

A plan that cannot hold one request of max_model_len is refused (ValueError) with what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# The CPU default, fixed rather than a share of MemAvailable: several workers share one host (`pdserve up`
# starts at least two, tests start many stacks at once), each would read MemAvailable at a different moment
# and together overcommit it; torch.zeros touches every page at start; and a fixed size keeps capacity, and
# so tests and benchmarks, the same from run to run. The start-up line says how many requests fit.
CPU_KV_CACHE_BYTES = 256 << 20

GIB = 1 << 30
MIB = 1 << 20


class KvSizing(StrEnum):
    """Which setting decided the pool's size (named as the setting, for messages)."""

    NUM_KV_BLOCKS = "num_kv_blocks"
    KV_CACHE_BYTES = "kv_cache_bytes"
    GPU_MEMORY_UTILIZATION = "gpu_memory_utilization"


# What to change when a plan holds less than one max-length request, by what sized it.
_REMEDY = {
    KvSizing.NUM_KV_BLOCKS: "raise num_kv_blocks or lower max_model_len",
    KvSizing.KV_CACHE_BYTES: "raise kv_cache_bytes (PDSERVE_KV_CACHE_BYTES) or lower max_model_len",
    KvSizing.GPU_MEMORY_UTILIZATION: (
        "raise gpu_memory_utilization (PDSERVE_GPU_MEMORY_UTILIZATION), free the device, lower "
        "max_num_batched_tokens (less activation memory), or lower max_model_len"
    ),
}


@dataclass(frozen=True)
class KvShape:
    """What a plan needs to know of the pool and the requests: bytes of one block (KVLayout.bytes_per_block:
    layers × 2 × block_size × KV heads × head dim × dtype size), tokens per block, the longest request."""

    bytes_per_block: int
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class CudaMemory:
    """One CUDA device, measured after the weights were loaded and a worst-case step was profiled (bytes)."""

    total: int  # the device's memory (torch.cuda.mem_get_info's total)
    weights: int  # allocated by torch in this process before the profiled step: weights and buffers
    activation_peak: int  # the step's peak allocation above that (torch.cuda.max_memory_allocated)
    # this engine's memory outside torch's allocator that appeared since it started (NCCL buffers, cuBLAS and
    # Triton workspaces): the used-but-not-reserved memory now minus at the engine's first look at the device.
    # Other processes' memory is not in it: a share of the device is this engine's own budget.
    non_torch: int
    free: int  # free on the device after the step (the allocator's cache emptied): the pool cannot exceed it


@dataclass(frozen=True)
class KvPlan:
    num_blocks: int
    shape: KvShape
    sizing: KvSizing
    budget: str  # how the size was arrived at, for the start-up line and refusals

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.shape.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    @property
    def max_len_requests(self) -> int:
        """Requests of max_model_len tokens that fit at once."""
        return self.tokens // self.shape.max_model_len

    def summary(self) -> str:
        """The engine's start-up line."""
        return (
            f"KV cache: {self.num_blocks} blocks x {self.shape.block_size} tokens = {self.tokens} tokens, "
            f"{_size(self.bytes)} ({self.budget}); holds {self.max_len_requests} requests of max_model_len "
            f"{self.shape.max_model_len}"
        )


def plan_blocks(num_blocks: int, shape: KvShape) -> KvPlan:
    """Exactly `num_blocks` blocks (tests). ValueError if they hold no max-length request."""
    return _checked(KvPlan(num_blocks, shape, KvSizing.NUM_KV_BLOCKS, f"num_kv_blocks {num_blocks}"))


def plan_bytes(budget_bytes: int, shape: KvShape) -> KvPlan:
    """As many whole blocks as `budget_bytes` holds. ValueError if they hold no max-length request."""
    blocks = max(budget_bytes, 0) // shape.bytes_per_block
    return _checked(KvPlan(blocks, shape, KvSizing.KV_CACHE_BYTES, f"kv_cache_bytes {_size(budget_bytes)}"))


def cuda_kv_bytes(memory: CudaMemory, utilization: float) -> int:
    """What `utilization` of the device leaves for KV once this engine's weights, activations and non-torch
    memory are counted; negative when they alone exceed it."""
    return int(memory.total * utilization) - memory.weights - memory.activation_peak - memory.non_torch


def plan_cuda(memory: CudaMemory, utilization: float, shape: KvShape) -> KvPlan:
    """The blocks that fit in `utilization` of a measured CUDA device and in its free memory. ValueError if
    they hold no max-length request (or nothing is left at all)."""
    share = cuda_kv_bytes(memory, utilization)
    how = (
        f"gpu_memory_utilization {utilization:g} x {_size(memory.total)} - weights {_size(memory.weights)} "
        f"- activations {_size(memory.activation_peak)} - non-torch {_size(memory.non_torch)} = {_size(share)}"
    )
    budget = share
    if memory.free < share:  # other processes hold what the share would take: the free memory is the limit
        budget = memory.free
        how += f", capped by the device's free {_size(memory.free)} (other processes use the rest)"
    blocks = max(budget, 0) // shape.bytes_per_block
    return _checked(KvPlan(blocks, shape, KvSizing.GPU_MEMORY_UTILIZATION, how))


def _checked(plan: KvPlan) -> KvPlan:
    if plan.tokens < plan.shape.max_model_len:
        raise ValueError(
            f"the KV pool holds {plan.tokens} tokens ({plan.num_blocks} blocks of {plan.shape.block_size}; "
            f"{plan.budget}), less than one request of max_model_len {plan.shape.max_model_len}: "
            f"{_REMEDY[plan.sizing]}"
        )
    return plan


def _size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB (sign kept: a CUDA budget can be negative)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class GroupNeed:
    """One KV cache group (shared/engine/kv_groups.py) as the memory plan sees it: its bytes per block and the
    blocks one max-length request holds in it at most (a full group: the whole sequence; a window group: the
    window plus a step's queries, kv_groups.window_live_blocks)."""

    name: str  # "full" or "window W", for the start-up line
    bytes_per_block: int
    blocks_per_request: int


def split_plan(total: KvPlan, needs: list[GroupNeed]) -> list[KvPlan]:
    """The budget of `total` (planned as if one pool held every layer) shared between KV cache groups so that
    each holds the same number of max-length requests: group g gets budget × need_g / Σ need_j, need_j =
    blocks_per_request × bytes_per_block. With num_kv_blocks (tests) every group gets that many blocks.
    ValueError when some group holds no request at all."""
    if total.sizing is KvSizing.NUM_KV_BLOCKS:
        counts = [total.num_blocks] * len(needs)
    else:
        per_request = sum(n.blocks_per_request * n.bytes_per_block for n in needs)
        requests = total.bytes // per_request
        counts = [requests * n.blocks_per_request for n in needs]
    plans = []
    for n, count in zip(needs, counts, strict=True):
        if count < n.blocks_per_request:
            raise ValueError(
                f"the {n.name} KV group gets {count} blocks, less than one request needs ({n.blocks_per_request}; "
                f"{total.budget}): {_REMEDY[total.sizing]}"
            )
        shape = KvShape(n.bytes_per_block, total.shape.block_size, total.shape.max_model_len)
        plans.append(KvPlan(count, shape, total.sizing, f"{n.name} layers' share of {total.budget}"))
    return plans


def grouped_summary(needs: list[GroupNeed], plans: list[KvPlan]) -> str:
    """The start-up line of a pool split into KV cache groups: blocks, tokens and bytes per group."""
    parts = [
        f"{n.name}: {p.num_blocks} blocks x {p.shape.block_size} = {p.tokens} tokens, {_size(p.bytes)}"
        for n, p in zip(needs, plans, strict=True)
    ]
    fits = min(p.num_blocks // n.blocks_per_request for n, p in zip(needs, plans, strict=True))
    return (
        f"KV cache in {len(plans)} groups ({'; '.join(parts)}; {plans[0].budget.split(' of ', 1)[-1]}); holds "
        f"{fits} requests of max_model_len {plans[0].shape.max_model_len}"
    )
