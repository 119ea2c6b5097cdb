"""YaRN rope against transformers' `_compute_yarn_parameters`, for the published gpt-oss config and variants
(truncated ramp, explicit attention factor, mscale / mscale_all_dim, a factor derived from the lengths)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.model.config import ModelConfig
from shared.model.layers import yarn_inv_freq_and_mscale

# openai/gpt-oss-20b's config.json as published (the fields the model reads)
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_the_published_gpt_oss_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(GPT_OSS_20B)
    assert cfg.layer_windows == (128, None) * 12
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 32.0 and not cfg.rope.truncate
    assert cfg.swiglu_limit == 7.0 and cfg.swiglu_alpha == 1.702


@pytest.mark.parametrize(
    "rope",
    [
        {},  # as published
        {"truncate": True},
        {"attention_factor": 1.3},
        {"mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0},
        {"factor": None},  # derived: max_position_embeddings / original_max_position_embeddings
    ],
    ids=["published", "truncated", "attention-factor", "mscale", "derived-factor"],
)
def test_yarn_matches_transformers(rope):
    raw = GPT_OSS_20B | {"rope_scaling": GPT_OSS_20B["rope_scaling"] | rope}
    hf = AutoConfig.for_model("gpt_oss", **{k: v for k, v in raw.items() if k != "model_type"})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_dict(raw)
    got_freq, got_factor = yarn_inv_freq_and_mscale(cfg.head_dim, cfg.rope)
    torch.testing.assert_close(got_freq, want_freq, rtol=0, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
