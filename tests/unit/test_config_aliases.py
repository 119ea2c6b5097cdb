"""config.json as each transformers version writes it → the same ModelConfig (shared/model/config_aliases.py).

Three sources of raw dicts: the installed transformers' own config classes (`XConfig(...).to_dict()`), literal
dicts as 4.4x wrote them (`rope_theta`, `rope_scaling` with `type`, `torch_dtype`, Qwen3-MoE's `num_experts`),
and sparse dicts with only the shapes, read against what transformers itself makes of them (its defaults).
"""

from __future__ import annotations

import pytest
import transformers

from shared.model.config import ARCHITECTURES, ModelConfig, UnsupportedModelError
from shared.model.config_aliases import ALIASES, ConfigFieldError, read_field, rope_parameters

SHAPES = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96)
# Per architecture: the extra constructor arguments of its transformers config class, by our canonical names'
# meaning (MoE sizes); all distinct from the class defaults so a field read from the wrong key shows.
EXTRA: dict[str, dict] = {
    "llama": dict(num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, max_position_embeddings=999),
    "qwen2": dict(num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=999),
    "qwen3": dict(num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, max_position_embeddings=999),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=3, rms_norm_eps=1e-6),
    "qwen2_moe": dict(
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=72,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
    ),
    "qwen3_moe": dict(
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "olmoe": dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, clip_qkv=8.0, rms_norm_eps=1e-6),
    "gpt_oss": dict(num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=3, sliding_window=32),
    "glm4_moe": dict(
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        first_k_dense_replace=1,
        n_shared_experts=2,
    ),
}
# DeepSeek's MLA sizes (tiny), shared by V2 (no query compression here) and V3
_MLA_SHAPES = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
EXTRA |= {
    "deepseek_v2": dict(
        _MLA_SHAPES,
        q_lora_rank=None,
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        first_k_dense_replace=1,
        n_shared_experts=1,
    ),
    "deepseek_v3": dict(
        _MLA_SHAPES,
        q_lora_rank=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
    ),
}
HF_CONFIG = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "olmoe": "OlmoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
    "glm4_moe": "Glm4MoeConfig",
    "gpt_oss": "GptOssConfig",
}


def _hf_config(arch: str, **kwargs):
    return getattr(transformers, HF_CONFIG[arch])(**kwargs)


def _expected(hf) -> dict:
    """What ModelConfig must hold, read from transformers' config object (its attributes, after its aliasing)."""
    heads = hf.num_attention_heads
    out = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=hf.num_key_value_heads or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
        rope_theta=hf.rope_parameters["rope_theta"],
    )
    if hf.model_type.startswith("deepseek"):
        # MLA: one latent entry per token for all heads (one "KV head"); head_dim is the rotary width, which
        # transformers 5.x also writes as head_dim
        out |= dict(num_kv_heads=1, head_dim=hf.qk_rope_head_dim)
    if hasattr(hf, "num_experts_per_tok") and hf.model_type != "llama":
        # transformers' attribute_map makes `num_experts` and `num_local_experts` both readable where aliased
        experts = getattr(hf, "num_local_experts", None) or getattr(hf, "n_routed_experts", None) or hf.num_experts
        out |= dict(num_experts=experts, num_experts_per_tok=hf.num_experts_per_tok)
    return out


def _ours(cfg: ModelConfig) -> dict:
    out = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_theta=cfg.rope.theta,
    )
    if cfg.is_moe:
        out |= dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_installed_transformers_config_class_reads_as_transformers_reads_it(arch):
    hf = _hf_config(arch, **SHAPES, **EXTRA[arch], dtype="bfloat16")
    ours = ModelConfig.from_dict(hf.to_dict())
    assert _ours(ours) == _expected(hf)
    assert ours.torch_dtype == "bfloat16"  # 5.x writes `dtype`, 4.x `torch_dtype`
    if ours.is_moe and arch not in ("mixtral", "olmoe", "gpt_oss"):
        assert ours.moe_intermediate_size == hf.moe_intermediate_size
        layers = range(hf.num_hidden_layers)
        dense = hf.mlp_only_layers if hasattr(hf, "mlp_only_layers") else range(hf.first_k_dense_replace)
        assert ours.sparse_layers == frozenset(i for i in layers if i not in dense)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_config_with_only_the_shapes_gets_transformers_defaults(arch):
    """Absent keys take the config class's defaults (Mixtral's eps 1e-5 and theta 1e6, Qwen3-MoE's 4 KV
    heads), not one default for all."""
    raw = {"model_type": arch, **SHAPES}
    moe = {
        "mixtral": {"num_local_experts": 4},
        "olmoe": {"num_experts": 8},  # its default top-k is 8
        "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
        "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
        "glm4_moe": {},  # every MoE size has a class default: 128 experts, top 8, width 1408
        "gpt_oss": {"num_local_experts": 8},
        "deepseek_v2": {"num_experts_per_tok": 2},  # DeepseekV2Config has no default top-k (None)
    }
    raw |= moe.get(arch, {})
    if arch == "qwen2_moe":
        raw["shared_expert_intermediate_size"] = 16
    hf = getattr(transformers, HF_CONFIG[arch]).from_dict(raw)
    assert _ours(ModelConfig.from_dict(raw)) == _expected(hf)


# --- literal dicts as older / newer versions write them ---------------------------------------------------

QWEN3_MOE_4X = {  # as transformers 4.51-4.57 (and every published Qwen3-MoE checkpoint) write it
    "model_type": "qwen3_moe",
    **SHAPES,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "sliding_window": None,
}
QWEN3_MOE_5X = {  # as transformers 5.x writes the same model
    **{k: v for k, v in QWEN3_MOE_4X.items() if k not in ("num_experts", "rope_theta", "rope_scaling", "torch_dtype")},
    "num_local_experts": 8,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "dtype": "bfloat16",
}


def test_qwen3_moe_num_local_experts_as_5x_writes_it_equals_num_experts_as_4x_wrote_it():
    assert ModelConfig.from_dict(QWEN3_MOE_5X) == ModelConfig.from_dict(QWEN3_MOE_4X)
    assert ModelConfig.from_dict(QWEN3_MOE_5X).num_experts == 8
    assert ModelConfig.from_dict(QWEN3_MOE_5X).rope.theta == 1e6


@pytest.mark.parametrize(
    ("arch", "spelling"),
    [("mixtral", "num_experts"), ("olmoe", "num_local_experts"), ("qwen3_moe", "num_experts")],
)
def test_expert_count_under_its_attribute_map_alias(arch, spelling):
    """transformers' `attribute_map` accepts the other spelling on load; so do we."""
    raw = {"model_type": arch, **SHAPES, spelling: 5, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert ModelConfig.from_dict(raw).num_experts == 5
    assert getattr(transformers, HF_CONFIG[arch]).from_dict(raw).num_experts == 5


def test_dtype_and_torch_dtype_are_one_field():
    base = {k: v for k, v in QWEN3_MOE_4X.items() if k != "torch_dtype"}
    assert ModelConfig.from_dict(base | {"dtype": "float16"}).torch_dtype == "float16"
    assert ModelConfig.from_dict(base | {"torch_dtype": "float16"}).torch_dtype == "float16"
    assert ModelConfig.from_dict(base | {"dtype": None}).torch_dtype is None  # 5.x writes null when unset


def test_llama3_rope_as_4x_rope_scaling_and_as_5x_rope_parameters():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = {"model_type": "llama", **SHAPES, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {"model_type": "llama", **SHAPES, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    assert ModelConfig.from_dict(old).rope == ModelConfig.from_dict(new).rope
    assert ModelConfig.from_dict(new).rope.kind == "llama3" and ModelConfig.from_dict(new).rope.theta == 5e5
    hf = transformers.LlamaConfig.from_dict(old)
    assert hf.rope_parameters["rope_theta"] == 5e5 and hf.rope_parameters["rope_type"] == "llama3"


def test_rope_scaling_type_before_4_45_reads_as_rope_type():
    raw = {"model_type": "llama", **SHAPES, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.kind, rope.factor, rope.theta) == ("linear", 2.0, 1e4)
    assert transformers.LlamaConfig.from_dict(raw).rope_parameters["rope_type"] == "linear"


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    raw = {
        "model_type": "llama",
        **SHAPES,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "rope_scaling": {"rope_type": "linear", "factor": 3.0, "rope_theta": 2e4},
    }
    assert ModelConfig.from_dict(raw).rope.kind == "linear"
    assert transformers.LlamaConfig.from_dict(raw).rope_parameters["rope_type"] == "linear"


def test_unsupported_rope_kind_is_refused_by_name():
    raw = {"model_type": "llama", **SHAPES, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_dict(raw)


# --- errors --------------------------------------------------------------------------------------------------


def test_a_missing_expert_count_names_every_spelling_tried():
    raw = {k: v for k, v in QWEN3_MOE_4X.items() if k != "num_experts"}
    with pytest.raises(ConfigFieldError, match="'num_local_experts' / 'num_experts'"):
        ModelConfig.from_dict(raw)


def test_two_spellings_that_disagree_are_refused():
    with pytest.raises(ConfigFieldError, match="num_experts"):
        ModelConfig.from_dict(QWEN3_MOE_4X | {"num_local_experts": 16})
    assert ModelConfig.from_dict(QWEN3_MOE_4X | {"num_local_experts": 8}).num_experts == 8  # agreeing is fine


@pytest.mark.parametrize(
    ("arch", "option"),
    [
        ("llama", {"attention_bias": True}),
        ("qwen3_moe", {"attention_bias": True}),
        ("llama", {"mlp_bias": True}),
        ("qwen3", {"hidden_act": "gelu"}),
    ],
)
def test_options_we_do_not_implement_are_refused_not_ignored(arch, option):
    raw = {"model_type": arch, **SHAPES, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    with pytest.raises(UnsupportedModelError, match=next(iter(option))):
        ModelConfig.from_dict(raw | option)


def test_qwen2_moe_qkv_bias_switch_is_read():
    raw = _hf_config("qwen2_moe", **SHAPES, **EXTRA["qwen2_moe"]).to_dict()
    assert ModelConfig.from_dict(raw).arch.qkv_bias
    assert not ModelConfig.from_dict(raw | {"qkv_bias": False}).arch.qkv_bias
    assert ModelConfig.from_dict({k: v for k, v in raw.items() if k != "qkv_bias"}).arch.qkv_bias  # 4.46: always


# --- the tables for the architectures other modules implement ----------------------------------------------

MLA_FIELDS = ("num_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_tables_read_the_installed_config_class(arch):
    kwargs = dict(n_routed_experts=12, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=8, qk_rope_head_dim=4)
    hf = _hf_config(arch, **SHAPES, **kwargs, v_head_dim=12, num_experts_per_tok=2, moe_intermediate_size=8)
    raw = hf.to_dict()
    got = {name: read_field(raw, arch, name) for name in MLA_FIELDS}
    assert got == {"num_experts": 12, "kv_lora_rank": 32, "q_lora_rank": 48} | dict(
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12
    )
    assert read_field(raw, arch, "first_k_dense_replace") == hf.first_k_dense_replace
    assert read_field(raw, arch, "n_shared_experts") == hf.n_shared_experts
    assert read_field(raw, arch, "routed_scaling_factor") == hf.routed_scaling_factor
    bare = {"model_type": arch, **SHAPES, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    hf_bare = getattr(transformers, HF_CONFIG[arch]).from_dict(bare)
    for name in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace"):
        assert read_field(bare, arch, name) == getattr(hf_bare, name), name


def test_deepseek_v3_mtp_layers_under_both_names():
    raw = {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}
    assert read_field(raw, "deepseek_v3", "num_mtp_layers") == 1
    assert read_field({"num_mtp_layers": 2}, "deepseek_v3", "num_mtp_layers") == 2


def test_glm4_moe_partial_rotary_factor_top_level_in_4x_inside_rope_parameters_in_5x():
    old = {"model_type": "glm4_moe", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    new = _hf_config("glm4_moe", **SHAPES, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}).to_dict()
    assert new["rope_parameters"]["partial_rotary_factor"] == 0.5  # 5.x moved it in
    assert rope_parameters(old, "glm4_moe") == rope_parameters(new, "glm4_moe")
    assert rope_parameters({}, "glm4_moe")["partial_rotary_factor"] == 0.5  # the class default


def test_gpt_oss_table_reads_the_installed_config_class():
    hf = _hf_config("gpt_oss", **SHAPES, num_local_experts=6, num_experts_per_tok=2, sliding_window=32)
    raw = hf.to_dict()
    assert read_field(raw, "gpt_oss", "num_experts") == 6
    assert read_field(raw, "gpt_oss", "sliding_window") == 32
    assert read_field(raw, "gpt_oss", "swiglu_limit") == 7.0
    assert rope_parameters(raw, "gpt_oss") == hf.rope_parameters
    # no rope keys at all: the YaRN defaults GptOssConfig applies
    bare = {"model_type": "gpt_oss", **SHAPES}
    assert rope_parameters(bare, "gpt_oss") == transformers.GptOssConfig.from_dict(bare).rope_parameters


def test_every_table_names_its_required_shapes():
    for arch, table in ALIASES.items():
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            assert table[name].required, (arch, name)
