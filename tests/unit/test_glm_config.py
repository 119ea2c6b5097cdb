"""GLM-4.5-MoE's config.json as transformers' Glm4MoeConfig reads it: its attention options, partial rotary,
routing, shared experts, dense first layers and MTP layers."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeConfig

from services.demo_model import demo_config
from shared.model.config import ModelConfig, QKNorm, SharedExpert, UnsupportedModelError
from shared.model.layers import Rotary, apply_rotary
from shared.model.router_config import Scoring, TopkMethod


def _glm(**overrides) -> dict:
    cfg = demo_config("glm4_moe") | {"num_hidden_layers": 4, "first_k_dense_replace": 2} | overrides
    return {k: v for k, v in cfg.items() if v is not None}


def test_published_style_config_parses_as_transformers_reads_it():
    raw = _glm()
    ours, theirs = ModelConfig.from_dict(raw), Glm4MoeConfig(**raw)
    assert ours.arch.qkv_bias and ours.arch.qk_norm is QKNorm.PER_HEAD
    assert ours.arch.shared_expert is SharedExpert.PLAIN
    assert ours.shared_expert_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts
    assert ours.sparse_layers == frozenset({2, 3})  # the first first_k_dense_replace layers dense
    assert ours.rope.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.mtp_layers == theirs.num_mtp_layers == 1
    r = ours.router
    assert (r.scoring, r.topk_method, r.correction_bias) == (Scoring.SIGMOID, TopkMethod.NOAUX_TC, True)
    assert (r.num_experts, r.top_k) == (theirs.n_routed_experts, theirs.num_experts_per_tok)
    assert (r.norm_topk_prob, r.routed_scaling_factor) == (theirs.norm_topk_prob, theirs.routed_scaling_factor)


@pytest.mark.parametrize(
    ("overrides", "factor"),
    [
        ({}, 0.5),  # top-level, as GLM-4.5's config.json
        ({"partial_rotary_factor": None}, 0.5),  # absent: Glm4MoeConfig's default
        ({"partial_rotary_factor": None, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}, 0.25),
        ({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}}, 1.0),
    ],
)
def test_partial_rotary_factor_is_resolved_as_transformers_does(overrides, factor):
    raw = _glm(**overrides)
    assert ModelConfig.from_dict(raw).rope.partial_rotary_factor == factor
    assert Glm4MoeConfig(**raw).rope_parameters["partial_rotary_factor"] == factor


def test_attention_options_off():
    cfg = ModelConfig.from_dict(_glm(attention_bias=False, use_qk_norm=False))
    assert not cfg.arch.qkv_bias and cfg.arch.qk_norm is QKNorm.NONE


def test_defaults_are_those_of_transformers_config_class():
    raw = {k: v for k, v in _glm().items() if k not in ("n_routed_experts", "first_k_dense_replace", "n_group")}
    ours, theirs = ModelConfig.from_dict(raw), Glm4MoeConfig(**raw)
    assert ours.num_experts == theirs.n_routed_experts == 128
    assert ours.sparse_layers == frozenset(range(theirs.first_k_dense_replace, 4))
    assert ours.router.n_group == theirs.n_group == 1


def test_partial_rotary_rotates_the_first_dims_and_keeps_the_rest():
    rope = ModelConfig.from_dict(_glm()).rope
    rotary = Rotary(16, 64, rope)
    rotary.fill()
    assert rotary.dim == 8 and rotary.cos.shape == (64, 8)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    q2, k2 = apply_rotary(q, k, rotary.tables(torch.arange(3, 8), torch.float32))
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])
    assert not torch.allclose(q2[..., :8], q[..., :8])
    # the rotated part is a rotation of pairs (i, i + dim/2): norms of each pair are kept
    pair = lambda t: t[..., :4] ** 2 + t[..., 4:8] ** 2  # noqa: E731
    torch.testing.assert_close(pair(q2), pair(q))


def test_an_odd_rotary_width_is_refused():
    with pytest.raises(UnsupportedModelError, match="even number"):
        ModelConfig.from_dict(_glm(partial_rotary_factor=0.2))  # 16 * 0.2 -> 3 dims
