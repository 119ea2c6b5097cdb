"""A sparse layer's routed experts: stacked weights, and the ways to compute their routing-weighted sum.

Shape legend: T tokens, D hidden, E experts, A = experts per token (top-k), I expert intermediate size.
Expert weights are stacked: gate_up (E, 2I, D), down (E, D, I).

Tensor-parallel with ep = 1 (shard.tp > 1): every rank holds every expert, each expert's intermediate cut
to this rank's 1/tp (I is then the local size). Under expert parallelism a rank holds whole experts, some
slots (`with_slots`). The block around them (router, shared expert, all-reduce) is moe.py's `MoE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.kernels import cpu_moe
from shared.model.kernels.choice import KernelChoice
from shared.model.layers import gated_mlp
from shared.model.linear import pack
from shared.model.tensor_parallel import TensorShard

# With the CPU expert kernel on, every batch takes it, prefill included (it runs on every intra-op thread, and
# beats both torch paths at prefill sizes: docs/journal/benchmarks.md, "The expert kernel for prefill too"), in
# slices of at most this many tokens: its scratch (per calling thread, kept for the next call) is tokens x top-k x
# (intermediate + hidden) floats, so a slice bounds it. Tokens are independent: slicing changes no bits.
CPU_KERNEL_SLICE_TOKENS = 1024


class Experts(nn.Module):
    fused_kernel = True  # the Triton fused_moe kernel computes these experts (a subclass may say it cannot)
    cpu_kernel = True  # SiLU-gated experts without biases: what shared/model/kernels/cpu_moe.c computes

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        shard: TensorShard = TensorShard.SINGLE,
        slots: list[int] | None = None,
    ) -> None:
        """shard: tensor parallelism splits each expert's intermediate size. slots: under expert parallelism,
        the logical expert of each of this rank's stacked slots (the placement's,
        shared/model/expert_parallel.py); None = all `num_experts`, in order."""
        super().__init__()
        self.shard = shard
        self.rows = shard.part(intermediate, "the experts' intermediate size")  # this rank's rows of each expert
        self.slots = list(range(num_experts)) if slots is None else list(slots)
        self.total_experts = num_experts  # the model's, per layer
        self.num_experts, self.intermediate = len(self.slots), len(self.rows)  # num_experts: stacked here
        intermediate = self.intermediate
        self.gate_up = nn.Parameter(torch.empty(self.num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(self.num_experts, hidden, intermediate))
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # the CPU expert kernel's weight panels and build (use_cpu_kernel); None = the torch paths
        self._panels: cpu_moe.ExpertPanels | None = None
        self._cpu_kernel: cpu_moe.Kernel | None = None
        # load-time int8 (shared/model/int8.py): ((q, scale) of gate_up, of down), what the CPU kernel's int8
        # panels are made of; the parameters then hold the dequantized values, which every other path reads
        self.int8: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        # TORCH or TRITON, set by CausalLM.use_kernels when the engine starts
        self.kernels = KernelChoice.TORCH

    def checkpoint_shards(self) -> dict[str, tuple]:
        i, rows, cols = self.intermediate, self.shard.source(self.rows), self.shard.source(None, self.rows)
        shards = {}
        for slot, e in enumerate(self.slots):
            shards[f"{e}.gate_proj.weight"] = ("gate_up", (slot, slice(0, i)), rows)
            shards[f"{e}.up_proj.weight"] = ("gate_up", (slot, slice(i, 2 * i)), rows)
            shards[f"{e}.down_proj.weight"] = ("down", (slot,), cols)
        return shards

    def with_slots(self, slots: list[int]) -> Experts:
        """A twin of this module (on the current default device) holding whole experts `slots`: expert
        parallelism's shard (shared/model/expert_shards.py shard_experts)."""
        return Experts(self.total_experts, self.down.shape[1], self.intermediate, slots=slots)

    def checkpoint_ignored(self) -> set[str]:
        """The checkpoint tensors of the experts other ranks hold: the loader skips them without reading."""
        held = set(self.slots)
        others = (e for e in range(self.total_experts) if e not in held)
        return {f"{e}.{proj}.weight" for e in others for proj in ("gate_proj", "up_proj", "down_proj")}

    def prepack(self) -> None:
        self._packed = [(pack(self.gate_up[e]), pack(self.down[e])) for e in range(self.num_experts)]

    def weights_changed(self) -> None:
        """Some slots' weights were replaced in place (live expert re-placement, shared/model/expert_moves.py):
        rebuild what was derived from them (the CPU kernel's panels, the oneDNN packs)."""
        if self._panels is not None and self._cpu_kernel is not None:
            self._panels = self._pack_panels(self._cpu_kernel)
        elif self._packed is not None:
            self.prepack()

    def use_cpu_kernel(self, kernel: cpu_moe.Kernel) -> str | None:
        """Re-lay the weights out for the CPU expert kernel build `kernel` (cpu_moe.kernels()), which then computes
        every batch: float32 or bfloat16 panels of the parameters, or int8 ones where load-time int8 kept them
        (`int8`); the oneDNN packs of the experts are dropped (the panels replace them). → None, or why these
        experts cannot use it (they keep the torch path)."""
        why = "not SiLU-gated plain experts" if not self.cpu_kernel else None
        why = why or ("not on the CPU" if self.down.device.type != "cpu" else None)
        why = why or kernel.supports(self.down.shape[1], self.intermediate, self.down.dtype)
        if why is None:
            self._panels = self._pack_panels(kernel)
            self._cpu_kernel, self._packed = kernel, None
        return why

    def _pack_panels(self, kernel: cpu_moe.Kernel) -> cpu_moe.ExpertPanels:
        """The kernel's panels of the weights: int8 ones where load-time int8 kept them, else of the parameters."""
        return kernel.pack_int8(*self.int8) if self.int8 is not None else kernel.pack(self.gate_up.data, self.down.data)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._packed[e] if self._packed is not None else (self.gate_up[e], self.down[e])

    def runs_cpu_kernel(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, ...)` takes the CPU expert kernel (forward_cpu_kernel), which needs no per-expert
        counts and can keep a counter itself (its `load`)."""
        return self._panels is not None and self.kernels is KernelChoice.TORCH and x.device.type == "cpu"

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """counts: (E,) tokens routed to each expert, on x's device. CPU: with the C expert kernel's panels, that
        kernel (use_cpu_kernel); else with oneDNN-packed weights, a loop
        over the active experts (packed weights do not stack, and on a host where packing pays it is ~3x
        faster per matmul than any stacked kernel there); with plain weights, `forward_grouped_mm`: two
        grouped matmuls, no Python loop over experts. On an accelerator the padded path, which never reads
        the counts on the host (that would stall the stream once per layer). With the Triton kernels:
        fused_moe over the plain (unpacked) weights, also without a host read."""
        if self.kernels is KernelChoice.TRITON and not self.fused_kernel:
            return self.forward_padded(x, topk_ids, topk_weights, counts)
        if self.kernels is KernelChoice.TRITON:
            # imported here: triton loads only when the kernels were chosen (it may be absent on a CPU host)
            from shared.model.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up, self.down, topk_ids, topk_weights)
        if x.device.type == "cpu":
            if self._panels is not None:
                return self.forward_cpu_kernel(x, topk_ids, topk_weights)
            if self._packed is not None:
                return self.forward_grouped(x, topk_ids, topk_weights, counts.tolist())
            return self.forward_grouped_mm(x, topk_ids, topk_weights, counts)
        return self.forward_padded(x, topk_ids, topk_weights, counts)

    def forward_grouped(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Sort the (token, expert) pairs by expert, one matmul pair per active expert (host counts). The
        tokens are gathered once and the results combined once: per expert only the two matmuls run."""
        pairs = sorted_pairs(x, topk_ids, topk_weights)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(gated_mlp(pairs.rows[start : start + n], *self.expert_weights(e)))
                start += n
        return pairs.combine(torch.cat(ys) if ys else pairs.rows)

    def forward_cpu_kernel(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, load: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same sum in one call of the CPU expert kernel (shared/model/kernels/cpu_moe.c): routing sort,
        both matmuls, SiLU * up and the weighted combine, over the panels use_cpu_kernel made. float32 and int8
        (float32 activations): products and sums in float32 (for A = 2 the sum rounds as the torch paths' does;
        the matmuls differ in the last bits); int8 gives the bits of float32 over the dequantized weights.
        bfloat16: float32 accumulation, rounded to bfloat16 where torch's bfloat16 ops round. load: an (E,) int64
        counter the kernel adds each expert's routed tokens to (MoE.expert_load), or None."""
        assert self._panels is not None and self._cpu_kernel is not None
        kernel, panels, n = self._cpu_kernel, self._panels, CPU_KERNEL_SLICE_TOKENS
        if x.shape[0] <= n:
            return kernel.moe(x, topk_ids, topk_weights, panels, load=load)
        return torch.cat(
            [
                kernel.moe(x[t : t + n], topk_ids[t : t + n], topk_weights[t : t + n], panels, load=load)
                for t in range(0, len(x), n)
            ]
        )

    def forward_grouped_mm(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The same sum as forward_grouped with no host read and no loop in Python: the sorted pairs go
        through torch's grouped matmul (F.grouped_mm; group e = expert e's run of rows, the groups' ends
        are the counts' cumsum on the device), over the plain stacked weights viewed as (E, in, out).
        torch 2.13's CPU kernel runs one GEMM per group, so on CPU this saves the Python loop and the host
        read, not GEMM time (docs/benchmarks.md)."""
        pairs = sorted_pairs(x, topk_ids, topk_weights)
        ends = counts.cumsum(0).to(torch.int32)  # (E,) grouped_mm's offsets: where each group's rows end
        gate, up = F.grouped_mm(pairs.rows, self.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return pairs.combine(F.grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends))

    def forward_padded(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The same sum with no host read: each expert gets T rows (top-k ids of a token are distinct, so no
        expert sees more), pairs scatter to (expert, rank within expert), two batched matmuls over all
        experts, results gather back. Costs E/A times the matmul work of the grouped path: the stopgap until
        a fused grouped kernel."""
        t, a = topk_ids.shape
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        expert_of_pair = flat[order]  # (T*A,) ascending
        token_of_pair = order // a
        first_pair = counts.cumsum(0) - counts  # (E,) where each expert's run of sorted pairs starts
        rank = torch.arange(t * a, device=x.device) - first_pair[expert_of_pair]
        rows = x.new_zeros(self.num_experts, t, x.shape[1])  # (E, T, D)
        rows[expert_of_pair, rank] = x[token_of_pair]
        gate, up = torch.bmm(rows, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, I) each
        y = torch.bmm(F.silu(gate) * up, self.down.transpose(1, 2))  # (E, T, D)
        weight_of_pair = topk_weights.flatten()[order].unsqueeze(1)
        out = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, topk_weights.dtype))
        return out.index_add_(0, token_of_pair, y[expert_of_pair, rank] * weight_of_pair).to(x.dtype)

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Plain per-token loop over the unpacked weights; the grouped path is tested against this."""
        out = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, topk_weights.dtype))
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t], strict=True):
                out[t] += w * gated_mlp(x[t : t + 1], self.gate_up[e], self.down[e])[0]
        return out.to(x.dtype)


@dataclass(frozen=True)
class _Pairs:
    """The (token, expert) pairs of a batch, sorted by expert (stable: a token's pairs keep their order)."""

    rows: torch.Tensor  # (T*A, D) the pairs' input rows, gathered from x
    order: torch.Tensor  # (T*A,) int64: sorted pair i is pair order[i] of the flat (T, A) routing
    weights: torch.Tensor  # (T, A) routing weights in routing order, in the dtype MoE.route gives them

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """y: (T*A, D) expert outputs of the sorted pairs → (T, D) routing-weighted sum per token. The outputs
        are put back in routing order (one index_copy_) and summed over A: no index_add_, whose CPU kernel
        (scatter_add_) was the slowest op of a loaded two-thread decode step (docs/benchmarks.md). Products
        and, for A = 2, sums round exactly as the index_add_ into zeros did."""
        t, a = self.weights.shape
        # index_copy_: whole rows to their routing positions (the same as unsorted[order] = y, a little cheaper)
        unsorted = torch.empty_like(y).index_copy_(0, self.order, y)
        # products and their sum in the weights' dtype, rounded once to y's (transformers' grouped/batched experts)
        return (unsorted.view(t, a, y.shape[1]) * self.weights.unsqueeze(2)).sum(1).to(y.dtype)


def sorted_pairs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> _Pairs:
    order = topk_ids.flatten().argsort(stable=True)
    # index_select copies whole rows: ~4x faster on CPU than advanced indexing x[...] (per-element kernel)
    return _Pairs(x.index_select(0, order // topk_ids.shape[1]), order, topk_weights)
