"""Mixture-of-Experts feed-forward: router (shared/model/routing.py), routed experts, optional shared expert.

Shape legend: T tokens, D hidden, E experts, A = experts per token (top-k). The routed experts (stacked
weights, their compute paths) are experts.py's `Experts` (gpt-oss's: clamped_experts.py).

Tensor-parallel with ep = 1 (shard.tp > 1): every rank holds every expert, each expert's intermediate cut
to this rank's 1/tp (I is then the local size); the router is replicated, so every rank routes alike, and
the block's output (routed experts + shared expert, both partial sums) is all-reduced once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.model.clamped_experts import ClampedSwiGLUExperts
from shared.model.config import ModelConfig, SharedExpert
from shared.model.expert_parallel import ExpertParallel
from shared.model.expert_trace import ExpertTrace
from shared.model.experts import Experts
from shared.model.kernels import cpu_moe
from shared.model.layers import GatedMLP
from shared.model.linear import PackedWeights, linear
from shared.model.routing import Router
from shared.model.tensor_parallel import TensorShard


def use_cpu_expert_kernel(model: nn.Module, builds: Sequence[cpu_moe.Kernel] | None = None) -> str:
    """Give every Experts module of `model` the CPU expert kernel where it can run (SiLU experts in float32,
    bfloat16 or load-time int8, on a CPU with AVX2 + FMA and gcc at hand): the first of `builds` (default
    cpu_moe.kernels(): the widest first) whose panel sizes divide the layer's; → a line for the engine's log
    saying what was chosen."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return "no routed experts"
    builds = cpu_moe.kernels() if builds is None else builds
    if not builds:
        return "torch (the kernel could not be built or run here, see the warning above)"
    refused, used = set(), {}
    for m in experts:
        why = None
        for kernel in builds:  # the widest first: the first that accepts these experts keeps them
            if (why := m.use_cpu_kernel(kernel)) is None:
                used[kernel.isa] = used.get(kernel.isa, 0) + 1
                break
        if why is not None:
            refused.add(why)  # the narrowest build's reason: no build computes these experts
    which = ", ".join(f"{isa} in {n}/{len(experts)} layers" for isa, n in used.items()) or f"0/{len(experts)} layers"
    rest = f" (torch in the rest: {'; '.join(sorted(refused))})" if refused else ""
    return f"cpu kernel {which}{rest}"


class MoE(nn.Module, PackedWeights):
    INT8_WEIGHTS = ()  # shared_expert_gate: one output row, nothing to save (shared/model/int8.py)
    expert_load: torch.Tensor  # (E,) buffer, see __init__

    def __init__(self, cfg: ModelConfig, shard: TensorShard = TensorShard.SINGLE, split_experts: bool = True) -> None:
        """shard: tensor parallelism (the shared expert is split over it, and the routed experts' intermediate
        size unless `split_experts` is False: under expert parallelism each rank holds whole experts)."""
        super().__init__()
        assert cfg.router is not None  # a sparse layer of an MoE config
        self.shard = shard
        self.gate = Router(cfg.router, cfg.hidden_size)  # replicated: every rank routes alike
        self.cast_weights = cfg.arch.routing_weights_in_activation_dtype
        expert_shard = shard if split_experts else TensorShard.SINGLE
        self.experts: Experts
        if cfg.arch.clamped_swiglu_experts:
            self.experts = ClampedSwiGLUExperts(
                cfg.num_experts,
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                expert_shard,
                alpha=cfg.swiglu_alpha,
                limit=cfg.swiglu_limit,
            )
        else:
            self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, expert_shard)
        # the always-on expert, named as the checkpoints name it (see SharedExpert)
        self.shared_kind = cfg.arch.shared_expert if cfg.shared_expert_intermediate_size else SharedExpert.NONE
        if self.shared_kind is SharedExpert.GATED:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, shard, reduce=False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.LINEAR_WEIGHTS = ("shared_expert_gate.weight",)
        elif self.shared_kind is SharedExpert.PLAIN:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, shard, reduce=False)
        # (E,) tokens routed to each expert since the last read (CausalLM.take_expert_load, once per heartbeat):
        # a buffer, so it accumulates on the model's device without a host read per layer.
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        # expert parallelism (shared/model/expert_shards.py shard_experts): this rank's experts are some
        # slots, and the routed sum is computed across the group; None = all experts here
        self.dispatch: ExpertParallel | None = None
        # per-request expert counts of the steps that ask (shared/engine/request_experts.py): the model's one trace
        # and this block's layer index in it; None = not traced
        self.trace: ExpertTrace | None = None
        self.trace_layer = 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ topk_ids (T, A) int64 and topk_weights (T, A) (shared/model/routing.py) in the dtype transformers
        scales the expert outputs with: x's where its router casts them (Qwen-MoE, OLMoE), else float32 (Mixtral,
        GLM). Every path multiplies and sums in that dtype and rounds the sum to x's: at bfloat16, transformers'
        rounding."""
        ids, weights = self.gate(x)
        return ids, weights.to(x.dtype) if self.cast_weights and weights.dtype != x.dtype else weights

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output (T, D), a partial sum under tensor parallelism; None without one."""
        if self.shared_kind is SharedExpert.GATED:
            return torch.sigmoid(linear(x, self.w("shared_expert_gate.weight"))) * self.shared_expert(x)
        if self.shared_kind is SharedExpert.PLAIN:
            return self.shared_experts(x)
        return None

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """A data-parallel attention rank without tokens this step: its part of the expert exchange, and the
        group's counts (shared/model/expert_parallel.py)."""
        assert self.dispatch is not None and self.dispatch.data_parallel
        self.dispatch.idle(self.experts, self.gate.in_features, dtype, device, self.gate.cfg.top_k)
        self.expert_load += self.dispatch.routed

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        ids, weights = self.route(x)
        if self.trace is not None:
            self.trace.add(self.trace_layer, ids)
        if self.dispatch is None and not reference and self.experts.runs_cpu_kernel(x):
            # the kernel counts the tokens per expert into expert_load as it sorts them (no bincount, no add)
            out = self.experts.forward_cpu_kernel(x, ids, weights, load=self.expert_load)
        else:
            out = self._routed(x, ids, weights, reference)
        shared = self.shared(x)
        if self.dispatch is not None:  # the routed sum is whole on every rank: only the shared expert's is partial
            return out if shared is None else out + self.shard.all_reduce_(shared)
        if shared is not None:
            out = out + shared
        return self.shard.all_reduce_(out)  # routed + shared partial sums, one all-reduce per block

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, reference: bool) -> torch.Tensor:
        """The routed experts' sum on every path but the CPU kernel's, expert_load counted here (under data-parallel
        attention: the group's counts, once the dispatch has exchanged them)."""
        flat = ids.flatten()
        if x.device.type == "cpu":  # (E,) per-expert counts: one op (its read of the max id costs nothing here)
            counts = torch.bincount(flat, minlength=self.expert_load.shape[0])
        else:  # on the device without a host read (bincount would read the max id on the host under CUDA)
            counts = torch.zeros_like(self.expert_load).index_add_(0, flat, torch.ones_like(flat))
        parallel_tokens = self.dispatch is not None and self.dispatch.data_parallel
        if not parallel_tokens:
            self.expert_load += counts
        if self.dispatch is not None:
            out = self.dispatch.forward(self.experts, x, ids, weights)
            if parallel_tokens:
                self.expert_load += self.dispatch.routed
            return out
        if reference:
            return self.experts.forward_reference(x, ids, weights)
        return self.experts(x, ids, weights, counts)
