"""How each architecture's `config.json` spells its fields, in every `transformers` version we read (4.46 … 5.24).

One declarative table per `model_type`: our canonical name → `Spelling(names, default)`. `names` lists every key
a `transformers` config class of that architecture has written or accepted for the field (its own field name and
its `attribute_map` aliases, old and new); `default` is the class default `transformers` applies when the key is
absent, so a sparse hand-written config reads as `transformers` would read it. `read_field(raw, arch, name)` is the
only reader: it tries the spellings in order, refuses two that disagree, and names every spelling it tried.

What moved between versions (the reason each alias is here):
- Expert count: Mixtral and gpt-oss write `num_local_experts`; Qwen2-MoE and OLMoE `num_experts`; Qwen3-MoE wrote
  `num_experts` up to 4.57 (and in every published checkpoint) and `num_local_experts` from 5.x (its
  `attribute_map` maps `num_experts` onto it); DeepSeek-V2/V3 and GLM-4.5 write `n_routed_experts` (5.x maps
  `num_experts` / `num_local_experts` onto it).
- Compute dtype: `torch_dtype` up to 4.5x, `dtype` from 5.0 (5.x writes `"dtype": null` when unset).
- RoPE: 4.x writes `rope_theta` + `rope_scaling` (`type` before 4.45, then `rope_type`); 5.x writes one
  `rope_parameters` dict holding `rope_theta` (and GLM's `partial_rotary_factor`, top-level before 5.0). Read by
  `rope_parameters()`, which merges them the way 5.x's `convert_rope_params_to_dict` does.
- DeepSeek-V3 / GLM-4.5 MTP layers: `num_nextn_predict_layers` (5.x `attribute_map`: `num_mtp_layers`).
- MLA configs: from 5.x `head_dim` is written as `qk_rope_head_dim` (not the attention head size): MLA code
  must read `qk_nope_head_dim` / `qk_rope_head_dim` / `v_head_dim`, never `head_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spelling:
    """The keys one field is written under (newest `transformers` first) and its default when none is present."""

    names: tuple[str, ...]
    default: Any = None
    required: bool = False  # absent → error (no meaningful default: the shapes)


def _s(*names: str, default: Any = None, required: bool = False) -> Spelling:
    return Spelling(names, default, required)


# Fields every decoder-only architecture here shares; defaults are overridden per architecture below.
_COMMON: dict[str, Spelling] = {
    "vocab_size": _s("vocab_size", required=True),
    "hidden_size": _s("hidden_size", required=True),
    "num_hidden_layers": _s("num_hidden_layers", required=True),
    "num_attention_heads": _s("num_attention_heads", required=True),
    "num_key_value_heads": _s("num_key_value_heads"),  # None → num_attention_heads
    "head_dim": _s("head_dim"),  # None → hidden_size // num_attention_heads
    "intermediate_size": _s("intermediate_size", required=True),
    "hidden_act": _s("hidden_act", default="silu"),
    "rms_norm_eps": _s("rms_norm_eps", default=1e-6),
    "max_position_embeddings": _s("max_position_embeddings", default=2048),
    "tie_word_embeddings": _s("tie_word_embeddings", default=False),
    "attention_bias": _s("attention_bias", default=False),
    "dtype": _s("dtype", "torch_dtype"),
    "eos_token_id": _s("eos_token_id"),  # no class default: generation_config.json decides the stop tokens
    "rope_theta_default": _s(default=10000.0),  # `default_theta` of the config class (no key of its own)
}
_QWEN_MOE: dict[str, Spelling] = {
    "num_experts_per_tok": _s("num_experts_per_tok", required=True),
    "moe_intermediate_size": _s("moe_intermediate_size", required=True),
    "norm_topk_prob": _s("norm_topk_prob", default=False),
    "decoder_sparse_step": _s("decoder_sparse_step", default=1),
    "mlp_only_layers": _s("mlp_only_layers", default=()),
    "use_sliding_window": _s("use_sliding_window", default=False),
}
# DeepSeek-V2/V3 and GLM-4.5 (routing with shared experts, dense first layers). The routers' own keys (n_group,
# topk_group, norm_topk_prob, routed_scaling_factor, topk_method) are read by shared/model/router_config.py; they are
# listed here too, with transformers' defaults, for the model code still to come.
_DEEPSEEK_MOE: dict[str, Spelling] = {
    "num_experts": _s("n_routed_experts", "num_experts", "num_local_experts", required=True),
    "num_experts_per_tok": _s("num_experts_per_tok", required=True),
    "moe_intermediate_size": _s("moe_intermediate_size", required=True),
    "n_shared_experts": _s("n_shared_experts", default=1),
    "routed_scaling_factor": _s("routed_scaling_factor", default=1.0),
    "n_group": _s("n_group", default=1),
    "topk_group": _s("topk_group", default=1),
    "first_k_dense_replace": _s("first_k_dense_replace", default=0),
    "norm_topk_prob": _s("norm_topk_prob", default=True),
}
_MLA: dict[str, Spelling] = {
    "kv_lora_rank": _s("kv_lora_rank", default=512),
    "q_lora_rank": _s("q_lora_rank", default=1536),  # None: queries projected without a low-rank step
    "qk_nope_head_dim": _s("qk_nope_head_dim", default=128),
    "qk_rope_head_dim": _s("qk_rope_head_dim", default=64),
    "v_head_dim": _s("v_head_dim", default=128),
}

ALIASES: dict[str, dict[str, Spelling]] = {
    "llama": _COMMON | {"mlp_bias": _s("mlp_bias", default=False), "pretraining_tp": _s("pretraining_tp", default=1)},
    "qwen2": _COMMON
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=32),
        "max_position_embeddings": _s("max_position_embeddings", default=32768),
        "use_sliding_window": _s("use_sliding_window", default=False),
    },
    "qwen3": _COMMON
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=32),
        "head_dim": _s("head_dim", default=128),
        "max_position_embeddings": _s("max_position_embeddings", default=32768),
        "use_sliding_window": _s("use_sliding_window", default=False),
    },
    "mixtral": _COMMON
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=8),
        "rms_norm_eps": _s("rms_norm_eps", default=1e-5),
        "max_position_embeddings": _s("max_position_embeddings", default=4096 * 32),
        "rope_theta_default": _s(default=1e6),
        "num_experts": _s("num_local_experts", "num_experts", required=True),
        "num_experts_per_tok": _s("num_experts_per_tok", default=2),
        "moe_intermediate_size": _s("intermediate_size", required=True),  # Mixtral's experts are its MLP
        "sliding_window": _s("sliding_window"),
    },
    "qwen2_moe": _COMMON
    | _QWEN_MOE
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=16),
        "intermediate_size": _s("intermediate_size", default=5632),  # only the dense layers' (mlp_only_layers)
        "max_position_embeddings": _s("max_position_embeddings", default=32768),
        "num_experts": _s("num_experts", required=True),
        "shared_expert_intermediate_size": _s("shared_expert_intermediate_size", required=True),
        "qkv_bias": _s("qkv_bias", default=True),  # a field from 4.57; always-on bias before
    },
    "qwen3_moe": _COMMON
    | _QWEN_MOE
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=4),
        "intermediate_size": _s("intermediate_size", default=6144),  # only the dense layers' (mlp_only_layers)
        "max_position_embeddings": _s("max_position_embeddings", default=32768),
        "num_experts": _s("num_local_experts", "num_experts", required=True),
    },
    "olmoe": _COMMON
    | {
        "rms_norm_eps": _s("rms_norm_eps", default=1e-5),
        "max_position_embeddings": _s("max_position_embeddings", default=4096),
        "num_experts": _s("num_experts", "num_local_experts", required=True),
        "num_experts_per_tok": _s("num_experts_per_tok", default=8),
        "moe_intermediate_size": _s("intermediate_size", required=True),  # OLMoE's experts are its MLP
        "norm_topk_prob": _s("norm_topk_prob", default=False),
        "clip_qkv": _s("clip_qkv"),
    },
    # Architectures whose model code other modules add; the tables are here so every config is read one way.
    "deepseek_v2": _COMMON
    | _DEEPSEEK_MOE
    | _MLA
    | {
        "num_experts": _s("n_routed_experts", "num_experts", "num_local_experts", default=64),
        "moe_intermediate_size": _s("moe_intermediate_size", default=1407),
        "n_shared_experts": _s("n_shared_experts", default=2),
        "n_group": _s("n_group"),
        "topk_group": _s("topk_group"),
        "topk_method": _s("topk_method", default="greedy"),
        "norm_topk_prob": _s("norm_topk_prob", default=False),
        "mlp_bias": _s("mlp_bias", default=False),
    },
    "deepseek_v3": _COMMON
    | _DEEPSEEK_MOE
    | _MLA
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=128),
        "max_position_embeddings": _s("max_position_embeddings", default=4096),
        "num_experts": _s("n_routed_experts", "num_local_experts", "num_experts", default=256),
        "moe_intermediate_size": _s("moe_intermediate_size", default=2048),
        "num_experts_per_tok": _s("num_experts_per_tok", default=8),
        "routed_scaling_factor": _s("routed_scaling_factor", default=2.5),
        "n_group": _s("n_group", default=8),
        "topk_group": _s("topk_group", default=4),
        "first_k_dense_replace": _s("first_k_dense_replace", default=3),
        "rope_interleave": _s("rope_interleave", default=True),
        "num_mtp_layers": _s("num_nextn_predict_layers", "num_mtp_layers", default=0),
    },
    "glm4_moe": _COMMON
    | _DEEPSEEK_MOE
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=8),
        "rms_norm_eps": _s("rms_norm_eps", default=1e-5),
        "max_position_embeddings": _s("max_position_embeddings", default=131072),
        "num_experts": _s("n_routed_experts", "num_local_experts", "num_experts", default=128),
        "moe_intermediate_size": _s("moe_intermediate_size", default=1408),
        "num_experts_per_tok": _s("num_experts_per_tok", default=8),
        "first_k_dense_replace": _s("first_k_dense_replace", default=1),
        "use_qk_norm": _s("use_qk_norm", default=False),
        # top-level up to 4.57, inside rope_parameters from 5.0: read through rope_parameters()
        "partial_rotary_factor": _s("partial_rotary_factor", default=0.5),
        "num_mtp_layers": _s("num_nextn_predict_layers", "num_mtp_layers", default=0),
    },
    "gpt_oss": _COMMON
    | {
        "num_key_value_heads": _s("num_key_value_heads", default=8),
        "head_dim": _s("head_dim", default=64),
        "rms_norm_eps": _s("rms_norm_eps", default=1e-5),
        "max_position_embeddings": _s("max_position_embeddings", default=131072),
        "rope_theta_default": _s(default=150000.0),
        "rope_parameters_default": _s(  # what 5.x's GptOssConfig sets when the config has none
            default={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            }
        ),
        "attention_bias": _s("attention_bias", default=True),
        "num_experts": _s("num_local_experts", "num_experts", required=True),
        "num_experts_per_tok": _s("num_experts_per_tok", default=4),
        "moe_intermediate_size": _s("intermediate_size", required=True),  # gpt-oss's experts are its MLP
        "sliding_window": _s("sliding_window", default=128),
        "layer_types": _s("layer_types"),  # None → sliding / full alternating, sliding first
        "swiglu_alpha": _s("swiglu_alpha", default=1.702),  # a field from 5.x; the modeling constant before
        "swiglu_limit": _s("swiglu_limit", default=7.0),
    },
}


class ConfigFieldError(ValueError):
    """A required field is absent, or two spellings of one field disagree."""


def read_field(raw: dict[str, Any], arch: str, name: str) -> Any:
    """The value of canonical field `name` in `raw` (a config.json of `model_type` `arch`), as `transformers`
    reads it: the first spelling present (all present spellings must agree), else the class default."""
    spelling = ALIASES[arch][name]
    present = {key: raw[key] for key in spelling.names if key in raw}
    values = list(present.values())
    if any(v != values[0] for v in values[1:]):
        raise ConfigFieldError(f"config.json spells {name!r} more than once with different values: {present}")
    if values:
        return values[0]
    if spelling.required:
        tried = " / ".join(repr(n) for n in spelling.names)
        raise ConfigFieldError(f"config.json ({arch}) is missing {tried}")
    return spelling.default


def rope_parameters(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """One RoPE dict (`rope_type`, `rope_theta`, the scaling keys, `partial_rotary_factor` where the
    architecture has one), from either the 5.x `rope_parameters` or the 4.x `rope_theta` + `rope_scaling`.

    Precedence as in 5.x's `convert_rope_params_to_dict`: a legacy `rope_scaling` dict replaces
    `rope_parameters`; keys inside the dict win over the top-level `rope_theta` / `partial_rotary_factor`,
    which win over the class defaults; `type` (before 4.45) is read as `rope_type`."""
    table = ALIASES[arch]
    default = table["rope_parameters_default"].default if "rope_parameters_default" in table else None
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or default or {})
    params.setdefault("rope_theta", raw.get("rope_theta", table["rope_theta_default"].default))
    if "partial_rotary_factor" in table:
        params.setdefault("partial_rotary_factor", read_field(raw, arch, "partial_rotary_factor"))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    return params
