"""The MoE router: which A of the E experts each token goes to, and with what weight.

Shape legend: T tokens, D hidden, E experts, G expert groups, A = experts per token (top-k).

Every supported architecture's router is one `RouterConfig` (parsed from the raw config.json by
`router_config`, torch-free in router_config.py) and one `Router` module (checkpoint `mlp.gate.weight`, and
for noaux_tc the float32 `mlp.gate.e_score_correction_bias`). The steps, in the order transformers runs them:

1. logits = x @ W.T (T, E): in the model dtype (Mixtral, Qwen, OLMoE) or in float32 (DeepSeek, GLM upcast
   x and W first); the scores are float32 either way: softmax over E, or an element-wise sigmoid.
2. selection scores = the scores, plus the correction bias under noaux_tc (DeepSeek-V3, GLM-4.5).
3. group limit (group_limited_greedy, noaux_tc): the E experts are G contiguous groups; each group is scored
   (V2: its best selection score; V3/GLM: the sum of its best two), the best `topk_group` groups are kept
   and every other expert is excluded.
4. top-A over the selection scores → ids; the weights are the *unbiased* scores of those ids.
5. weights / (their sum + 1e-20) when norm_topk_prob, then × routed_scaling_factor.

Device-clean: no step reads a tensor on the host, so a CUDA step never waits on the router. The router is
replicated under tensor and expert parallelism (every rank routes alike, shared/model/expert_parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.linear import PackedWeights, linear, pack
from shared.model.router_config import RouterConfig, Scoring, TopkMethod


class Router(nn.Module, PackedWeights):
    """`mlp.gate`: forward(x (T, D)) → topk_ids (T, A) int64, topk_weights (T, A) float32."""

    LINEAR_WEIGHTS = ("weight",)
    INT8_WEIGHTS = ()  # the scores decide routing: never int8 (shared/model/int8.py)
    e_score_correction_bias: torch.Tensor | None  # (E,) float32, noaux_tc only
    bias: nn.Parameter | None  # (E,) the logits' bias, gpt-oss only

    def __init__(self, cfg: RouterConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_features = hidden
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.logit_bias else None
        # a persistent buffer: loaded from the checkpoint like a weight, but never trained, and float32
        # whatever the model's dtype (see _apply), as transformers keeps it
        bias = torch.empty(cfg.num_experts, dtype=torch.float32) if cfg.correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """Moves and dtype casts of the module (`.to`, `to_empty`, `.cuda()`...) move the correction bias too,
        but leave it float32: cast to bfloat16 it would round away the small differences between experts'
        biases that decide the selection."""
        bias = self._buffers.pop("e_score_correction_bias", None)
        try:
            super()._apply(fn, recurse)
        finally:
            if bias is not None:
                moved = fn(bias)
                bias = moved if moved.dtype == torch.float32 else bias.to(moved.device)
            self._buffers["e_score_correction_bias"] = bias
        return self

    def panel_weights(self) -> tuple[str, ...]:
        """The panel linear gives a token's scores the same bits whatever its batch, as the scores must be (see
        logits), where oneDNN's packed GEMM does not at real routers' shapes (64-256 experts over 2048-7168: a
        lone token's scores differ from its scores in a batch). Not with a logit bias (gpt-oss): the panel adds
        it after the product, one more rounding than transformers' fused bias."""
        return ("weight",) if self.bias is None else ()

    def prepack(self) -> None:
        if "weight" in (self.__dict__.get("_formats") or {}):  # the panels serve it: no second copy
            return
        # float32 logits: pack the upcast weight, so the packed matmul is the float32 one
        weight = self.weight.float() if self.cfg.float32_logits else self.weight
        self.__dict__["_packed"] = {"weight": pack(weight)}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) → (T, E) float32."""
        # one weight whatever the batch: a token's scores, which decide its experts, must not depend on how many
        # tokens share its step (a chunked prompt, a layer-streamed prefill's last chunk, a recomputed request:
        # the same bits). A plain-weight path for small batches gave other bits and broke that
        # (tests/unit/test_panel_linear.py); so does oneDNN's packed GEMM at real routers' shapes, which the
        # panel linear serves where it can (panel_weights).
        weight = self.w("weight")
        if not isinstance(weight, torch.Tensor):  # the panel linear: float32 weights of a float32 model, no bias
            return linear(x, weight)
        if self.cfg.float32_logits:
            bias = None if self.bias is None else self.bias.float()
            return linear(x.float(), weight if weight.is_mkldnn else weight.float(), bias)
        logits = linear(x, weight, self.bias)
        return logits if logits.dtype == torch.float32 else logits.float()  # no conversion op when it is float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = self.logits(x)
        if cfg.scoring is Scoring.TOPK_SOFTMAX:
            top, ids = logits.topk(cfg.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        scores = torch.softmax(logits, dim=-1) if cfg.scoring is Scoring.SOFTMAX else torch.sigmoid(logits)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if cfg.grouped:
            choice = self._limit_groups(choice)
        if choice is scores:  # selected on the scores themselves: topk's values are the chosen scores
            weights, ids = scores.topk(cfg.top_k, dim=-1)  # (T, A) each
        else:  # biased or group-masked selection: the weights are the unbiased scores of the chosen experts
            ids = choice.topk(cfg.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)
            # +1e-20 as DeepSeek-V3/GLM write it. The top A of E softmax scores sum to at least A/E, where 1e-20 is
            # far below half an ulp: there the add cannot change a bit and is left out (one op a layer).
            top_softmax = cfg.scoring is Scoring.SOFTMAX and choice is scores
            weights = weights / (total if top_softmax else total + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return ids, weights

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice (T, E) → the same with the experts outside each token's best `topk_group` groups at -inf."""
        cfg = self.cfg
        grouped = choice.view(choice.shape[0], cfg.n_group, cfg.group_size)  # (T, G, E/G)
        if cfg.topk_method is TopkMethod.NOAUX_TC:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(cfg.topk_group, dim=-1).indices  # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
