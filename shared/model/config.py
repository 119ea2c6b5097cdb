"""HF `config.json` → `ModelConfig`: the one normalized description every model module reads.

Each supported `model_type` spells the same ideas differently (Mixtral's `num_local_experts`, Qwen's
`num_experts`, OLMoE's full-width q/k norm). They are resolved here once, so the layers never look at
the raw dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from shared.model.config_aliases import ALIASES, read_field, rope_parameters
from shared.model.mla import MLAConfig
from shared.model.router_config import RouterConfig, router_config


class QKNorm(Enum):
    """Where the architecture normalizes queries and keys before RoPE."""

    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3: RMSNorm over head_dim, weight shape (head_dim,)
    FULL = "full"  # OLMoE: RMSNorm over the whole projection, weight shape (heads * head_dim,)


class SharedExpert(Enum):
    """The MoE block's always-on expert, beside the routed ones."""

    NONE = "none"
    GATED = "gated"  # Qwen2-MoE: mlp.shared_expert, scaled by sigmoid(mlp.shared_expert_gate(x))
    PLAIN = "plain"  # DeepSeek, GLM-4.5: mlp.shared_experts (n_shared_experts fused into one MLP), no gate


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures, declared rather than branched on. (How each routes
    its tokens to experts is shared/model/routing.py's.)"""

    qkv_bias: bool = False
    qk_norm: QKNorm = QKNorm.NONE
    moe: bool = False
    shared_expert: SharedExpert = SharedExpert.NONE
    # GLM-4.5: the q/k/v bias (`attention_bias`) and the per-head q/k norm (`use_qk_norm`) are config options
    attention_options: bool = False
    # Qwen-MoE, OLMoE, gpt-oss: transformers casts the top-k weights to the activations' dtype before they scale the
    # expert outputs; Mixtral and GLM keep them float32 (only visible below float32: see MoE.route)
    routing_weights_in_activation_dtype: bool = False
    # gpt-oss: q/k/v and o projections with biases (config `attention_bias`), a learned per-head sink logit in
    # every softmax, and experts with biases and the clamped SwiGLU (shared/model/clamped_experts.py
    # ClampedSwiGLUExperts); its router (biased, top-k of the logits then their softmax) is routing.py's
    attention_sinks: bool = False
    o_bias: bool = False
    clamped_swiglu_experts: bool = False
    # gpt-oss: its RMSNorm multiplies the float32-normalized rows by the weight before casting back (layers.py)
    norm_weight_in_float32: bool = False
    # DeepSeek-V2: RoPE as a complex product in float32 (cos/sin never rounded), one cast of the result back;
    # V3 and the others rotate in the activations' dtype with tables already cast to it
    rope_in_float32: bool = False
    mla: bool = False  # DeepSeek: multi-head latent attention, a latent KV cache (shared/model/mla.py)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=QKNorm.PER_HEAD),
    "mixtral": ArchSpec(moe=True),
    "qwen2_moe": ArchSpec(
        qkv_bias=True, moe=True, shared_expert=SharedExpert.GATED, routing_weights_in_activation_dtype=True
    ),
    "qwen3_moe": ArchSpec(qk_norm=QKNorm.PER_HEAD, moe=True, routing_weights_in_activation_dtype=True),
    "olmoe": ArchSpec(qk_norm=QKNorm.FULL, moe=True, routing_weights_in_activation_dtype=True),
    "deepseek_v2": ArchSpec(moe=True, shared_expert=SharedExpert.PLAIN, mla=True, rope_in_float32=True),
    "deepseek_v3": ArchSpec(moe=True, shared_expert=SharedExpert.PLAIN, mla=True),
    "glm4_moe": ArchSpec(moe=True, shared_expert=SharedExpert.PLAIN, attention_options=True),
    "gpt_oss": ArchSpec(
        qkv_bias=True,
        moe=True,
        attention_sinks=True,
        o_bias=True,
        clamped_swiglu_experts=True,
        norm_weight_in_float32=True,
        routing_weights_in_activation_dtype=True,  # its router's softmax runs in the logits' dtype
    ),
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
    # the share of each head's dims that is rotated (GLM-4.5: 0.5): the first int(head_dim * factor) dims, as
    # two non-interleaved halves; the rest pass through unrotated
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        dim = int(head_dim * self.partial_rotary_factor)
        if dim <= 0 or dim % 2 or dim > head_dim:
            raise UnsupportedModelError(
                f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={head_dim} rotates {dim} dims: "
                "it must be an even number in [2, head_dim]"
            )
        return dim

    # yarn (shared/model/layers.py yarn_inv_freq_and_mscale): the ramp between interpolated and extrapolated
    # frequencies, and the attention factor that scales cos/sin (None: derived from factor / mscale); DeepSeek's
    # attention also scales its softmax by yarn_mscale(factor, mscale_all_dim)^2 (`softmax_scale_factor`)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def softmax_scale_factor(self) -> float:
        """What the attention's 1/sqrt(d) is multiplied by (DeepSeek's YaRN: mscale(factor, mscale_all_dim)^2, as
        transformers' yarn_apply_mscale; the cos/sin factor is separate, layers.py)."""
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
    router: RouterConfig | None = None  # None for dense models
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: frozenset[int] = field(default_factory=frozenset)
    eos_token_ids: tuple[int, ...] = ()
    # multi-head latent attention (arch.mla); num_kv_heads is then 1 (the latent, shared by all heads) and
    # head_dim the rotary width (qk_rope_head_dim), as transformers has it
    mla: MLAConfig | None = None
    # multi-token-prediction layers after the last one (GLM-4.5, DeepSeek-V3: model.layers.{num_layers + i}.*):
    # the checkpoint carries them, nothing here runs them (no speculative decoding), the loader skips them
    mtp_layers: int = 0
    # Per layer: its sliding window W (a query at position p sees keys p-W+1..p, W keys with itself, as
    # transformers' sliding_window_overlay), None = full attention. Empty = every layer full.
    layer_windows: tuple[int | None, ...] = ()
    # gpt-oss experts' clamped SwiGLU: glu = g * sigmoid(alpha * g) with g <= limit, times (clamp(u, ±limit) + 1)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

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

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None when it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def freeable_window(self) -> int | None:
        """When every layer slides: the largest window (blocks wholly behind it are read by no layer again and
        can be freed); None when some layer attends to the whole context."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)

    @property
    def has_full_layers(self) -> bool:
        return not self.layer_windows or None in self.layer_windows

    @property
    def windows(self) -> frozenset[int]:
        """The distinct sliding windows of the model's layers (empty: no sliding layer)."""
        return frozenset(w for w in self.layer_windows if w is not None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported architectures: {', '.join(sorted(ARCHITECTURES))}"
            )
        arch = _arch_options(raw, model_type)

        def get(name: str) -> Any:
            return read_field(raw, model_type, name)

        hidden = get("hidden_size")
        heads = get("num_attention_heads")
        num_layers = get("num_hidden_layers")
        moe = _moe_fields(raw, model_type, num_layers) if arch.moe else {}
        mla = MLAConfig.from_dict(raw) if arch.mla else None
        eos = get("eos_token_id")
        # MLA: the rotary width (qk_rope_head_dim), as transformers' DeepSeek configs set head_dim
        head_dim = mla.qk_rope_head_dim if mla else get("head_dim") or hidden // heads
        rope = _rope(rope_parameters(raw, model_type), get("max_position_embeddings"))
        rope.rotary_dim(head_dim)  # refuses a width that cannot be rotated, now rather than at model build
        extra: dict[str, Any] = {}
        if arch.clamped_swiglu_experts:
            extra = {"swiglu_alpha": get("swiglu_alpha"), "swiglu_limit": get("swiglu_limit")}
        return cls(
            model_type=model_type,
            arch=arch,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=1 if mla else get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size"),
            rms_norm_eps=get("rms_norm_eps"),
            rope=rope,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            torch_dtype=get("dtype"),
            clip_qkv=get("clip_qkv") if "clip_qkv" in ALIASES[model_type] else None,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            mla=mla,
            mtp_layers=raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers")) or 0,
            layer_windows=layer_windows(raw, model_type, num_layers),
            **moe,
            **extra,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        return cls.from_dict(json.loads(path.read_text()))


def _arch_options(raw: dict[str, Any], model_type: str) -> ArchSpec:
    """The architecture's spec with the options its config may switch; options we do not implement are
    refused here rather than loaded wrong."""
    arch = ARCHITECTURES[model_type]
    table = ALIASES[model_type]

    def get(name: str) -> Any:
        return read_field(raw, model_type, name)

    if arch.attention_options:  # GLM-4.5: q/k/v bias and per-head q/k norm switched by the config
        qk_norm = QKNorm.PER_HEAD if get("use_qk_norm") else QKNorm.NONE
        arch = replace(arch, qkv_bias=bool(get("attention_bias")), qk_norm=qk_norm)
    elif get("attention_bias") and not arch.qkv_bias:
        # transformers then biases q, k, v and o_proj; we implement Qwen2's q/k/v-only bias
        raise UnsupportedModelError(f"{model_type}: attention_bias=true is not supported")
    if get("hidden_act") != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act={get('hidden_act')!r} is not supported (silu)")
    if "mlp_bias" in table and get("mlp_bias"):
        raise UnsupportedModelError(f"{model_type}: mlp_bias=true is not supported")
    if "qkv_bias" in table:  # Qwen2-MoE: a switch since 4.57
        arch = replace(arch, qkv_bias=bool(get("qkv_bias")))
    return arch


def _moe_fields(raw: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    arch = ARCHITECTURES[model_type]
    table = ALIASES[model_type]

    def get(name: str) -> Any:
        return read_field(raw, model_type, name)

    num_experts, top_k = get("num_experts"), get("num_experts_per_tok")
    moe_intermediate = get("moe_intermediate_size")
    if "first_k_dense_replace" in table:
        # DeepSeek-style: the first `first_k_dense_replace` layers dense, then every `moe_layer_freq`-th layer
        # sparse (DeepSeek's own code; transformers reads no moe_layer_freq, and every published checkpoint has 1)
        first_dense, freq = get("first_k_dense_replace"), raw.get("moe_layer_freq") or 1
        sparse = frozenset(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    else:
        # Qwen-MoE can interleave dense layers; the others are sparse everywhere.
        step = (get("decoder_sparse_step") if "decoder_sparse_step" in table else 1) or 1
        dense_only = set((get("mlp_only_layers") if "mlp_only_layers" in table else None) or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    if arch.shared_expert is SharedExpert.GATED:
        shared = get("shared_expert_intermediate_size")
    elif arch.shared_expert is SharedExpert.PLAIN:  # the n_shared_experts shared experts: one MLP n times as wide
        shared = moe_intermediate * get("n_shared_experts")
    else:
        shared = 0
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_intermediate,
        "router": router_config(raw, model_type, num_experts, top_k),
        "shared_expert_intermediate_size": shared,
        "sparse_layers": sparse,
    }


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as the architecture's transformers config and modeling files read it
    (checked against each file; the parity tests hold them to it):

    - gpt_oss: `layer_types` (default: even layers sliding, odd full), window `sliding_window`.
    - mixtral: `sliding_window` on every layer when set (no use_sliding_window switch).
    - qwen3_moe: `sliding_window` on every layer when `use_sliding_window`.
    - qwen2, qwen3: `layer_types` (default: layers >= `max_window_layers` slide) when `use_sliding_window`.
    - qwen2_moe: `layer_types` (default: even layers below `max_window_layers`) when `use_sliding_window`.
    - llama, olmoe: none (their modeling files build a causal mask only).
    """
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    elif model_type == "gpt_oss":
        window = raw.get("sliding_window", 128)
    if model_type in ("llama", "olmoe") or not window:
        return ()
    if model_type in ("mixtral", "qwen3_moe"):
        return (window,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        if model_type == "gpt_oss":
            types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        elif model_type == "qwen2_moe":
            below = raw.get("max_window_layers", 28)
            types = [SLIDING if i % 2 == 0 and i < below else FULL for i in range(num_layers)]
        else:  # qwen2, qwen3
            above = raw.get("max_window_layers", 28)
            types = [SLIDING if i >= above else FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise UnsupportedModelError(f"{model_type}: layer_types {types!r} is not {num_layers} of {SLIDING}/{FULL}")
    windows = tuple(window if t == SLIDING else None for t in types)
    return windows if any(windows) else ()


def _rope(params: dict[str, Any], max_position: int) -> RopeConfig:
    """`params`: config_aliases.rope_parameters (one dict, whichever transformers version wrote the config)."""
    theta, kind = params["rope_theta"], params["rope_type"]
    partial = float(params.get("partial_rotary_factor", 1.0))
    if kind != "default" and partial != 1.0:
        raise UnsupportedModelError(f"rope scaling type {kind!r} with partial_rotary_factor is not supported")
    if kind == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
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
        original = params["original_max_position_embeddings"]
        factor = params.get("factor") or max_position / original
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=factor,
            original_max_position=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            truncate=params.get("truncate", True),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")
