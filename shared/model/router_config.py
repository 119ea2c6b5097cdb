"""What a MoE router computes, read from config.json (torch-free: the gateway reads the model's config too).

Every supported architecture's routing is one `RouterConfig`, parsed from the raw config.json by `router_config`
from the architecture's policy (what it fixes, what its config may set, with transformers' defaults); the
`Router` module that computes it, and the steps in the order transformers runs them, are routing.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Scoring(Enum):
    SOFTMAX = "softmax"  # over the E logits
    SIGMOID = "sigmoid"  # per logit
    TOPK_SOFTMAX = "topk_softmax"  # gpt-oss: select on the logits, then softmax over the chosen A logits


class TopkMethod(Enum):
    GREEDY = "greedy"  # top-A of all experts
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # DeepSeek-V2: groups scored by their best expert
    NOAUX_TC = "noaux_tc"  # DeepSeek-V3, GLM-4.5: biased selection, groups scored by their best two


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    topk_method: TopkMethod = TopkMethod.GREEDY
    n_group: int = 1  # expert groups (group-limited methods only)
    topk_group: int = 1  # groups a token may choose from
    norm_topk_prob: bool = False  # renormalize the A weights to sum to 1
    routed_scaling_factor: float = 1.0
    float32_logits: bool = False  # the router matmul in float32 (x and W upcast), not in the model dtype
    logit_bias: bool = False  # gpt-oss: the router linear has a bias (checkpoint `mlp.router.bias`)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"router: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.grouped:
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"router: n_group={self.n_group} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"router: topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.top_k > self.topk_group * self.group_size:
                raise ValueError(
                    f"router: top_k={self.top_k} exceeds the {self.topk_group * self.group_size} experts of "
                    f"topk_group={self.topk_group} groups"
                )
            if self.topk_method is TopkMethod.NOAUX_TC and self.group_size < 2:
                raise ValueError("router: noaux_tc scores a group by its best two experts: groups need two or more")

    @property
    def grouped(self) -> bool:
        return self.topk_method is not TopkMethod.GREEDY

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group

    @property
    def correction_bias(self) -> bool:
        """noaux_tc selects on scores + a learned per-expert bias (checkpoint `e_score_correction_bias`)."""
        return self.topk_method is TopkMethod.NOAUX_TC


@dataclass(frozen=True)
class _Policy:
    """What an architecture fixes about its router, and the defaults of what its config may set (the
    defaults of transformers' config class for that model_type)."""

    scoring: Scoring = Scoring.SOFTMAX
    topk_method: TopkMethod = TopkMethod.GREEDY
    method_from_config: bool = False  # DeepSeek-V2 reads topk_method; the others fix it
    always_renormalize: bool = False  # Mixtral renormalizes whatever the config says
    norm_from_config: bool = True  # DeepSeek-V2's router never renormalizes (transformers ignores the key)
    norm_default: bool = False
    n_group: int | None = 1
    topk_group: int | None = 1
    scaling_default: float = 1.0
    float32_logits: bool = False
    logit_bias: bool = False


_POLICIES: dict[str, _Policy] = {
    "mixtral": _Policy(always_renormalize=True),
    "qwen2_moe": _Policy(),
    "qwen3_moe": _Policy(),
    "olmoe": _Policy(),
    "deepseek_v2": _Policy(
        method_from_config=True, norm_from_config=False, n_group=None, topk_group=None, float32_logits=True
    ),
    "deepseek_v3": _Policy(
        scoring=Scoring.SIGMOID,
        topk_method=TopkMethod.NOAUX_TC,
        norm_default=True,
        n_group=8,
        topk_group=4,
        scaling_default=2.5,
        float32_logits=True,
    ),
    "glm4_moe": _Policy(
        scoring=Scoring.SIGMOID, topk_method=TopkMethod.NOAUX_TC, norm_default=True, float32_logits=True
    ),
    # gpt-oss: top-A of the biased logits, their softmax the weights (already summing to 1)
    "gpt_oss": _Policy(scoring=Scoring.TOPK_SOFTMAX, logit_bias=True),
}


def router_config(raw: dict[str, Any], model_type: str, num_experts: int, top_k: int) -> RouterConfig:
    """The router of a config.json of `model_type` (its expert count and top-k already resolved by the caller,
    shared/model/config.py, which owns their spellings). ValueError when the config asks for a routing the
    architecture does not have (a DeepSeek-V3 `scoring_func` other than sigmoid) or that does not fit."""
    if model_type not in _POLICIES:
        raise ValueError(f"no MoE router is defined for model_type {model_type!r}")
    p = _POLICIES[model_type]
    method = TopkMethod(raw.get("topk_method") or "greedy") if p.method_from_config else p.topk_method
    _check_declared(raw, model_type, "topk_method", method.value)
    _check_declared(raw, model_type, "scoring_func", p.scoring.value)
    grouped = method is not TopkMethod.GREEDY
    n_group = raw.get("n_group", p.n_group)
    topk_group = raw.get("topk_group", p.topk_group)
    if grouped and (n_group is None or topk_group is None):
        raise ValueError(f"{model_type}: topk_method={method.value} needs n_group and topk_group in config.json")
    if p.always_renormalize:
        norm = True
    elif p.norm_from_config:
        norm = bool(raw.get("norm_topk_prob", p.norm_default))
    else:
        norm = False
    return RouterConfig(
        num_experts=num_experts,
        top_k=top_k,
        scoring=p.scoring,
        topk_method=method,
        n_group=n_group if grouped else 1,
        topk_group=topk_group if grouped else 1,
        norm_topk_prob=norm,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", p.scaling_default)),
        float32_logits=p.float32_logits,
        logit_bias=p.logit_bias,
    )


def _check_declared(raw: dict[str, Any], model_type: str, key: str, implemented: str) -> None:
    """A config key transformers ignores for this architecture must not ask for something else."""
    declared = raw.get(key)
    if declared is not None and declared != implemented:
        raise ValueError(f"{model_type}: config.json sets {key}={declared!r}; the architecture uses {implemented!r}")
