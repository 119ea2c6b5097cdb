"""Mixture-of-Experts feed-forward: router, routed experts, optional shared expert.

Shape legend: T tokens, D hidden, E experts, A = experts per token (top-k), I expert intermediate size.
Expert weights are stacked: gate_up (E, 2I, D), down (E, D, I).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import GatedMLP, gated_mlp
from shared.model.linear import PackedWeights, linear, pack


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def checkpoint_shards(self) -> dict[str, tuple[str, tuple]]:
        i = self.intermediate
        shards = {}
        for e in range(self.num_experts):
            shards[f"{e}.gate_proj.weight"] = ("gate_up", (e, slice(0, i)))
            shards[f"{e}.up_proj.weight"] = ("gate_up", (e, slice(i, 2 * i)))
            shards[f"{e}.down_proj.weight"] = ("down", (e,))
        return shards

    def prepack(self) -> None:
        self._packed = [(pack(self.gate_up[e]), pack(self.down[e])) for e in range(self.num_experts)]

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._packed[e] if self._packed is not None else (self.gate_up[e], self.down[e])

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Grouped path: sort the (token, expert) pairs by expert, one matmul pair per active expert.
        counts: (E,) tokens routed to each expert (the router's bincount, shared with the load counter)."""
        a = topk_ids.shape[1]
        order = topk_ids.flatten().argsort(stable=True)
        token_of_pair = order // a  # which token each sorted pair came from
        weight_of_pair = topk_weights.flatten()[order].unsqueeze(1).to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            idx = token_of_pair[start : start + n]
            y = gated_mlp(x[idx], *self.expert_weights(e))
            out.index_add_(0, idx, y * weight_of_pair[start : start + n])
            start += n
        return out

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Plain per-token loop over the unpacked weights; the grouped path is tested against this."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t], strict=True):
                out[t] += w.to(x.dtype) * gated_mlp(x[t : t + 1], self.gate_up[e], self.down[e])[0]
        return out


class MoE(nn.Module, PackedWeights):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.LINEAR_WEIGHTS = ("gate.weight",)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.LINEAR_WEIGHTS += ("shared_expert_gate.weight",)
        # Tokens routed to each expert since the last read; the services export it as expert load.
        self.expert_load = torch.zeros(cfg.num_experts, dtype=torch.int64)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ topk_ids (T, A) int64, topk_weights (T, A) float32."""
        probs = torch.softmax(linear(x, self.w("gate.weight")).float(), dim=-1)  # (T, E)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        ids, weights = self.route(x)
        counts = torch.bincount(ids.flatten(), minlength=self.expert_load.numel())
        self.expert_load += counts
        if reference:
            out = self.experts.forward_reference(x, ids, weights)
        else:
            out = self.experts(x, ids, weights, counts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(linear(x, self.w("shared_expert_gate.weight")))
            out = out + gate * self.shared_expert(x)
        return out
