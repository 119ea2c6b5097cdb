"""The engine's configuration: what one engine is built from. Plain frozen dataclasses (no torch here), a
docstring per field: the worker's settings nest them, and their environment names, flags and help come from
these declarations (shared/config_fields.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from shared.model.kernels.choice import KernelChoice

# the enum only: shared/model/expert_parallel.py imports torch, so the enum lives in a torch-free module
from shared.sharding.dispatch import EPDispatch
from shared.sharding.layout import ParallelLayout

# cpu, cuda, cuda:N (meta: tensors without data, for placement tests); availability is checked when the
# engine starts (shared/model/device.py resolve_device), this only refuses what can never be a device.
_DEVICE = re.compile(r"cpu|meta|cuda(:\d+)?")


class Dtype(StrEnum):
    """Weight and KV dtypes the model loader knows (shared/model/loader.py DTYPES)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(StrEnum):
    """Weight formats made at load from a float checkpoint (shared/model/quantization.py LOAD_METHODS; the
    methods themselves: shared/model/int8.py)."""

    INT8 = "int8"
    """Weight-only int8, one scale per output channel; the CPU kernels read int8."""
    INT8_DEQUANTIZED = "int8_dequantized"
    """int8's twin: the same int8 weights dequantized to float32 once (its reference: int8 gives its numbers)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching policy (shared/engine/scheduler.py)."""

    max_num_seqs: int = 64
    """Requests holding KV and running at once."""
    max_num_batched_tokens: int = 512
    """Tokens through the model per step (the prefill chunk budget)."""
    enable_chunked_prefill: bool = True
    """Cut long prompts to fit the step's budget, sharing steps with decodes; without it a whole prompt runs
    in one step (max_num_batched_tokens must then hold max_model_len)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass(frozen=True)
class EplbConfig:
    """Live expert re-placement of an expert-parallel worker group (shared/parallel/eplb.py): the group keeps a
    window of its own expert load and, at a bounded rate, moves the expert slots a better placement changes
    between its ranks at step boundaries. Each role's group plans from its own load (per phase)."""

    enabled: bool = field(default=False, metadata={"name": "eplb"})
    """Re-place experts live from this group's own load (needs an MoE model and ep > 1; refused otherwise)."""
    window_steps: int = 256
    """Steps of expert load (tokens routed to each expert, per layer) the planner looks at."""
    interval_s: float = 30.0
    """At most one placement is planned per this many seconds (a rebalance in progress delays the next)."""
    redundant: int = 0
    """Redundant expert slots per layer (replicas of hot experts) over the whole group; (experts + redundant) must
    split evenly over ep. The group holds them from the start."""
    min_gain: float = 0.05
    """Apply a planned placement only when it lowers the predicted busiest-rank load over the mean by at least
    this relative amount (0.05 = 5 %); in [0, 1)."""
    stage_layers: int = 1
    """Changed layers a move stages per step boundary (0: every changed layer at one boundary). 1 bounds what a
    boundary pauses to one layer's slots; more brings a new placement in sooner (the old one serves until every
    layer is staged)."""

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"--eplb-window-steps must be at least 1, got {self.window_steps}")
        if not self.interval_s > 0:
            raise ValueError(f"--eplb-interval-s must be positive, got {self.interval_s}")
        if self.redundant < 0:
            raise ValueError(f"--eplb-redundant must be 0 or more, got {self.redundant}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"--eplb-min-gain must be in [0, 1), got {self.min_gain}")
        if self.stage_layers < 0:
            raise ValueError(f"--eplb-stage-layers must be 0 (all at once) or more, got {self.stage_layers}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Checkpoint directory (Hugging Face layout)."""
    dtype: Dtype | None = None
    """Weight and KV dtype; None = the checkpoint's own."""
    quantization: Quantization | None = None
    """Quantize the weights at load from a float checkpoint: int8 = weight-only int8 with one scale per output
    channel, computed by the CPU kernels with float32 activations (float32 dtype, CPU only; the routed experts
    and the dense linears whose sizes fit, shared/model/int8.py); int8_dequantized = its float32 twin. None =
    the checkpoint's weights as they are. Refused for a checkpoint that is already quantized."""
    device: str = "cpu"
    """torch device of the model and the KV pool (cpu, cuda, cuda:1)."""
    threads: int | None = None
    """torch intra-op threads (process-wide: the engine sets them when built); None = torch's default."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_bytes: int | None = None
    """Bytes the KV pool is cut from; None = 256 MiB on CPU, and on CUDA what gpu_memory_utilization leaves."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the share of the device's total memory this engine may use (weights, activations of a profiled
    worst-case step, KV pool); the KV pool gets the rest. Ignored when kv_cache_bytes or num_kv_blocks is set."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool, instead of a memory budget (tests)."""
    max_model_len: int | None = None
    """Prompt + output tokens of one request; None = the model's max_position_embeddings."""
    seed: int | None = None
    """Sampling seed of requests without a seed of their own."""
    prepack_weights: bool = True
    """oneDNN-packed matmul weights on CPU (faster; a second copy of them)."""
    cpu_expert_kernel: bool = True
    """On CPU with the torch kernels, SiLU experts (float32, bfloat16, or int8 of `quantization`) run the C expert
    kernel, decode and prefill batches alike (shared/model/kernels/cpu_moe.c, built with gcc at first use;
    AVX-512F (+ AVX512_BF16 for bfloat16) where the CPU has it, else AVX2 + FMA, the same bits either way; on
    `threads` intra-op threads), and so do int8 dense linears
    instead of the BLAS path; where it cannot be built or run, the torch path, with a log line. False = the torch
    path (the kernel's reference). On by default at any thread count: it was faster at 1 and 2 threads
    (docs/journal/benchmarks.md, "the expert kernel threaded")."""
    cpu_attention_kernel: bool = True
    """On CPU with the torch kernels, a float32 model's decode attention runs the C kernel
    (shared/model/kernels/cpu_attention.c, built with gcc at first use; AVX-512 or AVX2 + FMA; on `threads`
    intra-op threads), which reads each sequence's KV blocks in place, instead of the buckets' gather + SDPA;
    models with attention sinks or latent attention, other dtypes, or a host where it cannot be built or run
    keep the torch path (logged). False = the torch path (the kernel's reference)."""
    kv_shared_memory: bool = False
    """On CPU, a single-process engine of one KV cache group: the KV pool lives in a memfd (shared_pool.py) that
    decode workers on the same host map read-only, to copy a request's blocks straight into their own pool (a
    prefill worker's hand-off: one copy). Ignored elsewhere (logged)."""
    cpu_linear_kernel: bool = True
    """On CPU with the torch kernels, a float32 model's dense projections (attention's, dense MLPs', the LM
    head's) run the C panel linear (shared/model/panel_linear.py, in the expert kernel's library), which streams
    each weight without oneDNN's per-call overhead (decode steps gain most); its panels replace the oneDNN pack
    of those weights. Where the kernel cannot be built or run, the torch path (logged). False = the torch path
    (its reference; the two differ in summation order)."""
    cpu_norm_kernel: bool = True
    """On CPU, a float32 model's RMSNorms and each attention layer's q/k norm + RoPE run the C kernel
    (shared/model/kernels/cpu_norm_rope.c, built with gcc at first use, any x86-64), one call each instead of
    torch's five ops; where it cannot be built, the torch ops (logged). False = the torch ops (its reference)."""
    kernels: KernelChoice = KernelChoice.AUTO
    """Decode attention and MoE experts: auto = triton on CUDA when triton is installed, else torch; torch =
    the plain-torch path (the CPU path and the kernels' reference); triton = the Triton kernels (on CPU only
    under TRITON_INTERPRET=1, for tests). Resolved once when the engine starts, and logged."""
    cuda_graphs: bool = True
    """Replay decode-only steps from CUDA graphs captured at start, one per batch-size bucket (1, 2, 4, 8, 16,
    24, ... up to max_num_seqs); effective only on CUDA with kernels=triton, else every step runs eagerly."""
    overlap_scheduling: bool = False
    """Plan the next step and build its inputs while the current step's forward runs on a forward thread, one
    step ahead of the sampled tokens (shared/engine/overlap.py); the same greedy and seeded tokens either way.
    Steps run in lockstep while a request has a grammar, penalties or prompt logprobs, choices wait to be
    forked, or on a worker group. Off by default: on the 2-core CPU hosts measured no speed-up showed
    (docs/benchmarks.md, "Overlap scheduling")."""
    tp: int = 1
    """Tensor-parallel degree: attention heads, dense MLPs, the experts' intermediate size and the untied LM
    head's vocabulary split over this many ranks of the worker group (shared/sharding/layout.py)."""
    ep: int = 1
    """Expert-parallel degree: routed experts partitioned over this many ranks. Each of tp and ep is 1 or the
    group size (max(tp, ep) ranks)."""
    ep_dispatch: EPDispatch = EPDispatch.ALLREDUCE
    """How expert-parallel ranks combine: alltoall = each rank sends its 1/ep of the tokens to the experts'
    ranks and back, then all-gathers; allreduce = every rank computes its experts for all tokens, one
    all-reduce. allreduce is the default: at EP = 2 on CPU (gloo) it measured faster for prefill- and
    decode-sized batches (one collective against four all-to-alls and an all-gather; docs/benchmarks.md)."""
    dp_attention: bool = False
    """Data-parallel attention over the expert-parallel ranks (DeepSeek-style decode): each of the ep ranks runs
    attention and the dense layers for its own requests over its own KV pool, and the MoE layers dispatch every
    rank's tokens to the experts' ranks and back (all-to-all, whatever --ep-dispatch says). Needs ep > 1, tp = 1
    and an MoE model; the leader gives each request to the least loaded rank (shared/parallel/dp_attention.py).
    Prefix caching is off under it (the partitioned pool has no prefix cache yet)."""
    expert_placement: str | None = None
    """JSON file from `pdserve experts plan`: which experts (and redundant replicas) each EP rank holds per
    layer; None = a contiguous 1/ep of the experts per rank. Refused when it does not match the model or ep."""
    eplb: EplbConfig = field(default_factory=EplbConfig, metadata={"prefix": "eplb_"})
    group_timeout_s: float = 30.0
    """A worker group's collectives (and its ranks' start) fail after this long instead of waiting forever on
    a dead or hung rank; a follower idle between steps waits for its leader without limit."""
    enable_prefix_caching: bool = True
    """Keep the KV blocks of computed prompt prefixes after their requests end (evicted least recently used first
    when the pool runs out) and let a later request with the same prefix and cache salt reuse them instead of
    computing them (shared/engine/prefix_caching.py). --no-prefix-caching turns it off."""
    prefix_cache_namespace: str = field(default="", metadata={"flag": False})
    """The root of the prefix-cache hashes (shared/prefix_hash.py): a worker sets it to the model name it serves,
    the name the gateway hashes prompts with; not a setting of its own."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"ep must be at least 1, got {self.ep}")
        if self.ep_dispatch not in tuple(EPDispatch):
            raise ValueError(f"unknown ep_dispatch {self.ep_dispatch!r}; choose one of {', '.join(EPDispatch)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"unknown device {self.device!r}: choose cpu, cuda or cuda:N")
        if self.dtype is not None and self.dtype not in tuple(Dtype):
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(Dtype)}")
        if self.quantization is not None and self.quantization not in tuple(Quantization):
            raise ValueError(
                f"unknown quantization {self.quantization!r}; choose one of {', '.join(Quantization)} (or none)"
            )
        if self.quantization == Quantization.INT8 and self.dtype not in (None, Dtype.FLOAT32):
            raise ValueError(f"quantization int8 computes in float32: dtype {self.dtype} cannot go with it")
        if self.kernels not in tuple(KernelChoice):
            raise ValueError(f"unknown kernels {self.kernels!r}; choose one of {', '.join(KernelChoice)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.dp_attention and self.ep == 1:
            raise ValueError(
                "--dp-attention runs attention data-parallel over the expert-parallel ranks: it needs --ep > 1"
            )
        # refuses degrees a group cannot have (LayoutError, a ValueError)
        ParallelLayout(self.tp, self.ep, self.ep if self.dp_attention else 1)
        if self.eplb.enabled and self.ep == 1:
            raise ValueError(
                "--eplb re-places experts between expert-parallel ranks: it needs ep > 1 (this engine has ep=1)"
            )
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s must be positive, got {self.group_timeout_s}")

    @property
    def parallel(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.ep, self.ep if self.dp_attention else 1)
