"""HF `config.json` → `ModelConfig`: the one normalized description every model module reads.

Each supported `model_type` spells the same ideas differently (Mixtral's `num_local_experts`, Qwen's
`num_experts`, OLMoE's full-width q/k norm). They are resolved here once, so the layers never look at
the raw dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from shared.model.mla import MLAConfig


class QKNorm(Enum):
    """Where the architecture normalizes queries and keys before RoPE."""

    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3: RMSNorm over head_dim, weight shape (head_dim,)
    FULL = "full"  # OLMoE: RMSNorm over the whole projection, weight shape (heads * head_dim,)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures, declared rather than branched on."""

    qkv_bias: bool = False
    qk_norm: QKNorm = QKNorm.NONE
    moe: bool = False
    shared_expert: bool = False  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    always_renormalize: bool = False  # Mixtral renormalizes top-k weights regardless of config
    mla: bool = False  # DeepSeek: multi-head latent attention, a latent KV cache (shared/model/mla.py)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=QKNorm.PER_HEAD),
    "mixtral": ArchSpec(moe=True, always_renormalize=True),
    "qwen2_moe": ArchSpec(qkv_bias=True, moe=True, shared_expert=True),
    "qwen3_moe": ArchSpec(qk_norm=QKNorm.PER_HEAD, moe=True),
    "olmoe": ArchSpec(qk_norm=QKNorm.FULL, moe=True),
    "deepseek_v2": ArchSpec(moe=True, mla=True),
    "deepseek_v3": ArchSpec(moe=True, mla=True),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn: the band between beta_fast and beta_slow rotations is interpolated; cos/sin are multiplied by
    # `attention_factor`, and softmax scales by yarn_mscale(factor, mscale_all_dim)^2 (`softmax_scale_factor`)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def softmax_scale_factor(self) -> float:
        """What the attention's 1/sqrt(d) is multiplied by (DeepSeek's YaRN: mscale^2 when mscale_all_dim)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    arch: ArchSpec
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None = None
    clip_qkv: float | None = None
    # MoE fields; num_experts == 0 for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: frozenset[int] = field(default_factory=frozenset)
    eos_token_ids: tuple[int, ...] = ()
    # multi-head latent attention (arch.mla); num_kv_heads is then 1 (the latent, shared by all heads) and
    # head_dim the rotary width (qk_rope_head_dim), as transformers has it
    mla: MLAConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_planes(self) -> int:
        """Tensors a layer caches per token and head: 2 (K and V), 1 for MLA's latent."""
        return 1 if self.mla else 2

    @property
    def kv_width(self) -> int:
        """Values per token, head and plane in the cache: head_dim, or MLA's [c_kv | k_pe] width."""
        return self.mla.latent_width if self.mla else self.head_dim

    def layer_is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported architectures: {', '.join(sorted(ARCHITECTURES))}"
            )
        arch = ARCHITECTURES[model_type]
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{model_type}: use_sliding_window=true is not supported")

        hidden = _require(raw, "hidden_size")
        heads = _require(raw, "num_attention_heads")
        num_layers = _require(raw, "num_hidden_layers")
        moe = _moe_fields(raw, model_type, num_layers) if arch.moe else {}
        mla = MLAConfig.from_dict(raw) if arch.mla else None
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            arch=arch,
            vocab_size=_require(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=1 if mla else raw.get("num_key_value_heads") or heads,
            head_dim=mla.qk_rope_head_dim if mla else raw.get("head_dim") or hidden // heads,
            intermediate_size=raw.get("intermediate_size", 0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            clip_qkv=raw.get("clip_qkv"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            mla=mla,
            **moe,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        return cls.from_dict(json.loads(path.read_text()))


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"config.json is missing {key!r}")
    return raw[key]


def _moe_fields(raw: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    arch = ARCHITECTURES[model_type]
    if model_type == "mixtral":
        num_experts = _require(raw, "num_local_experts")
        moe_intermediate = _require(raw, "intermediate_size")
    elif model_type == "olmoe":
        num_experts = _require(raw, "num_experts")
        moe_intermediate = _require(raw, "intermediate_size")
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe_fields(raw, num_layers)
    else:
        num_experts = _require(raw, "num_experts")
        moe_intermediate = _require(raw, "moe_intermediate_size")
    # Qwen-MoE can interleave dense layers; the others are sparse everywhere.
    step = raw.get("decoder_sparse_step", 1) or 1
    dense_only = set(raw.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": _require(raw, "num_experts_per_tok"),
        "moe_intermediate_size": moe_intermediate,
        "norm_topk_prob": arch.always_renormalize or bool(raw.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", 0) if arch.shared_expert else 0,
        "sparse_layers": sparse,
    }


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind=kind, factor=params["factor"])
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position=params["original_max_position_embeddings"],
        )
    if kind == "yarn":
        original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
        factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
        mscale, mscale_all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
        attention_factor = params.get("attention_factor")
        if attention_factor is None and mscale and mscale_all_dim:  # transformers' _compute_yarn_parameters
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        elif attention_factor is None:
            attention_factor = yarn_mscale(factor)
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=factor,
            original_max_position=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
            mscale_all_dim=float(mscale_all_dim),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _deepseek_moe_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek-V2/V3: the first `first_k_dense_replace` layers are dense, the rest MoE."""
    first_dense = raw.get("first_k_dense_replace") or 0
    sparse = frozenset(range(first_dense, num_layers))
    if sparse:
        raise UnsupportedModelError(
            f"{raw['model_type']}: MoE layers need DeepSeek's routing (not yet wired); "
            f"only all-dense checkpoints (first_k_dense_replace >= num_hidden_layers) load"
        )
    return {
        "num_experts": _require(raw, "n_routed_experts"),
        "num_experts_per_tok": _require(raw, "num_experts_per_tok"),
        "moe_intermediate_size": _require(raw, "moe_intermediate_size"),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
    }
