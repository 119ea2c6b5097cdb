"""gpt-oss's routed experts: biased projections and the clamped SwiGLU, from stacked checkpoint tensors.

Per expert e and token row x (D,):
    h = x @ gate_up[e] + gate_up_bias[e]            (2I,)  gate and up interleaved in the checkpoint: h[0::2], h[1::2]
    g = min(h_gate, limit); u = clamp(h_up, -limit, limit)
    y = ((u + 1) * g * sigmoid(alpha * g)) @ down[e] + down_bias[e]      (D,)
as transformers' GptOssExperts computes it. The checkpoint stores `mlp.experts.gate_up_proj` (E, D, 2I),
`gate_up_proj_bias` (E, 2I), `down_proj` (E, I, D), `down_proj_bias` (E, D): inputs times weight, not the
(out, in) of nn.Linear. At load they are put in our experts' layout: gate_up (E, 2I, D) with the gate rows
first and the up rows after (de-interleaved), down (E, D, I), so the matmul paths are the plain Experts'.

Tensor-parallel (shard.tp > 1): each rank holds its 1/tp of every expert's intermediate rows (gate, up and
their bias rows, down's columns); the down bias is a whole-row term, held by rank 0 only (zeros elsewhere),
so the MoE block's one all-reduce adds it once. Expert parallelism: a rank loads its slots' experts from the
stacked tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.experts import Experts, sorted_pairs
from shared.model.linear import linear
from shared.model.tensor_parallel import TensorShard


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up (N, 2I) in our layout (gate columns, then up columns) → (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUExperts(Experts):
    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        shard: TensorShard = TensorShard.SINGLE,
        slots: list[int] | None = None,
        *,
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__(num_experts, hidden, intermediate, shard, slots)
        self.alpha, self.limit = alpha, limit
        self.full_intermediate = intermediate
        self.gate_up_bias = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate))
        self.down_bias = nn.Parameter(torch.empty(self.num_experts, hidden))

    def with_slots(self, slots: list[int]) -> ClampedSwiGLUExperts:
        return ClampedSwiGLUExperts(
            self.total_experts,
            self.down.shape[1],
            self.full_intermediate,
            slots=slots,
            alpha=self.alpha,
            limit=self.limit,
        )

    def checkpoint_shards(self) -> dict[str, tuple]:
        # one stacked checkpoint tensor per parameter, re-laid out by `_convert` after it is read whole
        return {
            name: (param, (), (), self._convert(name))
            for name, param in (
                ("gate_up_proj", "gate_up"),
                ("gate_up_proj_bias", "gate_up_bias"),
                ("down_proj", "down"),
                ("down_proj_bias", "down_bias"),
            )
        }

    def checkpoint_ignored(self) -> set[str]:
        return set()  # stacked: every rank reads the tensors, keeps its slots

    def _convert(self, name: str):
        rows = self.rows
        slots = torch.tensor(self.slots, dtype=torch.int64)
        zero_bias = self.shard.split and self.shard.rank != 0

        def convert(t: torch.Tensor) -> torch.Tensor:
            t = t.index_select(0, slots)
            if name == "gate_up_proj":  # (E, D, 2I) interleaved → (E, 2I', D): gate rows, then up rows
                t = t.transpose(1, 2)
                return torch.cat([t[:, 0::2][:, rows.start : rows.stop], t[:, 1::2][:, rows.start : rows.stop]], 1)
            if name == "gate_up_proj_bias":  # (E, 2I) interleaved → (E, 2I')
                return torch.cat([t[:, 0::2][:, rows.start : rows.stop], t[:, 1::2][:, rows.start : rows.stop]], 1)
            if name == "down_proj":  # (E, I, D) → (E, D, I')
                return t[:, rows.start : rows.stop].transpose(1, 2)
            return torch.zeros_like(t) if zero_bias else t  # down_proj_bias (E, D)

        return convert

    # The Experts paths (its `forward` picks one), with the biases and the clamped activation. The Triton
    # fused_moe kernel has neither: these experts take the padded torch path there (`fused_kernel`).
    fused_kernel = False
    cpu_kernel = False  # nor has the CPU expert kernel (shared/model/kernels/cpu_moe.c)

    def forward_grouped(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        pairs = sorted_pairs(x, topk_ids, topk_weights)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate_up, down = self.expert_weights(e)
                h = linear(pairs.rows[start : start + n], gate_up, self.gate_up_bias[e])
                ys.append(linear(clamped_swiglu(h, self.alpha, self.limit), down, self.down_bias[e]))
                start += n
        return pairs.combine(torch.cat(ys) if ys else pairs.rows)

    def forward_grouped_mm(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        pairs = sorted_pairs(x, topk_ids, topk_weights)
        expert_of_pair = topk_ids.flatten()[pairs.order]
        ends = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(pairs.rows, self.gate_up.transpose(1, 2), offs=ends) + self.gate_up_bias[expert_of_pair]
        act = clamped_swiglu(h, self.alpha, self.limit)
        y = F.grouped_mm(act, self.down.transpose(1, 2), offs=ends) + self.down_bias[expert_of_pair]
        return pairs.combine(y)

    def forward_padded(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        t, a = topk_ids.shape
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        expert_of_pair = flat[order]
        token_of_pair = order // a
        first_pair = counts.cumsum(0) - counts
        rank = torch.arange(t * a, device=x.device) - first_pair[expert_of_pair]
        rows = x.new_zeros(self.num_experts, t, x.shape[1])  # (E, T, D)
        rows[expert_of_pair, rank] = x[token_of_pair]
        h = torch.bmm(rows, self.gate_up.transpose(1, 2)) + self.gate_up_bias[:, None]  # (E, T, 2I)
        y = torch.bmm(clamped_swiglu(h, self.alpha, self.limit), self.down.transpose(1, 2)) + self.down_bias[:, None]
        weight_of_pair = topk_weights.flatten()[order].unsqueeze(1).to(x.dtype)
        out = torch.zeros_like(x)
        return out.index_add_(0, token_of_pair, y[expert_of_pair, rank] * weight_of_pair)

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t], strict=True):
                h = x[t : t + 1] @ self.gate_up[e].T + self.gate_up_bias[e]
                y = clamped_swiglu(h, self.alpha, self.limit) @ self.down[e].T + self.down_bias[e]
                out[t] += w.to(x.dtype) * y[0]
        return out
