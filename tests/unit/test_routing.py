"""The router of every MoE architecture against transformers' own router module, on the same weights: the
same experts and the same weights per token (DeepSeek-V2's two methods, DeepSeek-V3's and GLM-4.5's
biased group-limited selection, the softmax routers of Mixtral, Qwen and OLMoE)."""

from __future__ import annotations

import importlib

import pytest
import torch

from services.demo_model import demo_config
from shared.model.config import ArchSpec, ModelConfig, RopeConfig, SharedExpert
from shared.model.linear import can_prepack
from shared.model.moe import MoE
from shared.model.router_config import RouterConfig, Scoring, TopkMethod, router_config
from shared.model.routing import Router

HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 16, 4, 200

# transformers' config and router classes of each model_type
CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralTopKRouter"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeTopKRouter"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeTopKRouter"),
    "olmoe": ("OlmoeConfig", "OlmoeTopKRouter"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2TopkRouter"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3TopkRouter"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeTopkRouter"),
}
GROUPS = {"n_group": 4, "topk_group": 2}
# case → (model_type, config overrides)
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"norm_topk_prob": False}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "olmoe": ("olmoe", {"norm_topk_prob": False}),
    "deepseek_v2-greedy": ("deepseek_v2", {"topk_method": "greedy", "routed_scaling_factor": 1.5}),
    "deepseek_v2-group_limited_greedy": (
        "deepseek_v2",
        {"topk_method": "group_limited_greedy", **GROUPS, "routed_scaling_factor": 16.0},
    ),
    "deepseek_v3": ("deepseek_v3", {**GROUPS, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    "deepseek_v3-unnormalized": ("deepseek_v3", {"n_group": 4, "topk_group": 1, "norm_topk_prob": False}),
    "glm4_moe": ("glm4_moe", {"n_group": 1, "topk_group": 1, "norm_topk_prob": True}),
    "glm4_moe-grouped": ("glm4_moe", {**GROUPS, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
}


def _hf_config(case: str):
    module, overrides = CASES[case]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.configuration_{module}"), CLASSES[module][0])
    experts = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}
    experts_key = experts.get(module, "n_routed_experts" if module == "glm4_moe" else "num_experts")
    kwargs = {
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        experts_key: EXPERTS,
        "num_experts_per_tok": TOP_K,
        **overrides,
    }
    if module in ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"):
        kwargs["moe_intermediate_size"] = 8
    return cls(**kwargs)


def _pair(case: str, seed: int = 0) -> tuple[torch.nn.Module, Router]:
    """transformers' router and ours, with the same random weights (and correction bias)."""
    module = CASES[case][0]
    hf_cfg = _hf_config(case)
    router_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), CLASSES[module][1])
    theirs = router_cls(hf_cfg)
    raw = hf_cfg.to_dict()
    # the expert count's spelling is shared/model/config.py's (and varies by transformers version): given here
    cfg = router_config(raw, module, EXPERTS, TOP_K)
    ours = Router(cfg, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5)
        theirs.weight.copy_(ours.weight)
        if cfg.correction_bias:
            # of the order of the score differences: it changes which experts are chosen
            ours.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS, generator=gen))
            theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    return theirs, ours


def _by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) in ascending expert order: the order top-k lists them in is not semantic."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("case", sorted(CASES))
def test_router_matches_transformers(case):
    theirs, ours = _pair(case)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_weights, ref_ids = theirs(x)
        ids, weights = ours(x)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (TOKENS, TOP_K)
    ids, weights = _by_expert(ids, weights)
    ref_ids, ref_weights = _by_expert(ref_ids, ref_weights)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_router_routes_alike(case, dtype):
    """The oneDNN-packed weight (what prepack_weights gives on CPU; for the float32 routers of a bfloat16
    model, the upcast weight packed) routes as the plain one."""
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU cannot pack {dtype} weights (the engine keeps them plain here)")
    _, ours = _pair(case)
    ours.to(dtype)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        plain = ours(x)
        ours.prepack()
        packed = ours(x)
    assert torch.equal(plain[0], packed[0])
    torch.testing.assert_close(plain[1], packed[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("experts,top_k", [(16, 1), (16, 4), (256, 8)])
def test_renormalized_top_softmax_weights_are_the_bits_of_the_written_formula(experts, top_k):
    """norm_topk_prob over plain top-A softmax scores leaves out the +1e-20 the formula writes (it cannot change a
    bit there, see Router.forward): the weights are still bitwise weights / (weights.sum + 1e-20)."""
    cfg = RouterConfig(num_experts=experts, top_k=top_k, scoring=Scoring.SOFTMAX, norm_topk_prob=True)
    router = Router(cfg, HIDDEN)
    gen = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=gen) * 4)  # peaked and flat scores both
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        ids, weights = router(x)
        top = torch.softmax(router.logits(x), dim=-1).gather(1, ids)
    assert torch.equal(weights, top / (top.sum(dim=-1, keepdim=True) + 1e-20))


def test_the_correction_bias_and_the_group_limit_change_the_choice():
    """The cases above would pass for a router that ignored the bias or the groups if neither mattered on
    their inputs: they do matter there."""
    _, ours = _pair("deepseek_v3")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, weights = ours(x)
        scores = torch.sigmoid(ours.logits(x))
        unbiased = scores.topk(TOP_K, dim=-1).indices.sort(dim=-1).values
        biased = (scores + ours.e_score_correction_bias).topk(TOP_K, dim=-1).indices.sort(dim=-1).values
    chosen = ids.sort(dim=-1).values
    assert (chosen != unbiased).any(dim=-1).sum() > TOKENS // 10
    assert (chosen != biased).any(dim=-1).sum() > TOKENS // 10  # the group limit
    # each token's experts lie in topk_group = 2 of the 4 groups
    assert all(len(set(row)) <= 2 for row in (ids // (EXPERTS // 4)).tolist())
    torch.testing.assert_close(weights.sum(-1), torch.full((TOKENS,), 2.5))  # normalized, then scaled


def test_correction_bias_stays_float32_and_follows_the_module():
    _, ours = _pair("glm4_moe")
    bias = ours.e_score_correction_bias.clone()
    ours.to(torch.bfloat16)
    assert ours.weight.dtype == torch.bfloat16
    assert ours.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.e_score_correction_bias, bias)  # not rounded through bfloat16
    with torch.device("meta"):
        empty = Router(ours.cfg, HIDDEN)
    empty.to(torch.bfloat16).to_empty(device="cpu")
    assert empty.e_score_correction_bias.device.type == "cpu"
    assert empty.e_score_correction_bias.dtype == torch.float32
    assert "e_score_correction_bias" in empty.state_dict()  # persistent: the loader fills it


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe-grouped"])
def test_bfloat16_routing_matches_transformers(case):
    """DeepSeek/GLM route in float32 from bfloat16 weights and activations (x and W upcast), as transformers."""
    theirs, ours = _pair(case)
    theirs.weight.data = theirs.weight.data.to(torch.bfloat16)  # its bias stays float32, as from_pretrained keeps it
    ours.to(torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        _, ref_weights, ref_ids = theirs(x)
        ids, weights = _by_expert(*ours(x))
    ref_ids, ref_weights = _by_expert(ref_ids, ref_weights)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_an_empty_batch_routes_to_nothing():
    _, ours = _pair("deepseek_v3")
    ids, weights = ours(torch.empty(0, HIDDEN))
    assert ids.shape == (0, TOP_K) and weights.shape == (0, TOP_K)


def test_existing_architectures_are_expressed_in_the_router_config():
    mixtral = ModelConfig.from_dict(demo_config("mixtral")).router
    assert mixtral.norm_topk_prob  # Mixtral always renormalizes
    assert (mixtral.scoring, mixtral.topk_method, mixtral.float32_logits) == (Scoring.SOFTMAX, TopkMethod.GREEDY, False)
    glm = _pair("glm4_moe-grouped")[1].cfg
    assert (glm.scoring, glm.topk_method, glm.correction_bias) == (Scoring.SIGMOID, TopkMethod.NOAUX_TC, True)
    assert (glm.n_group, glm.topk_group, glm.routed_scaling_factor) == (4, 2, 2.5)


def test_configs_that_ask_for_another_routing_are_refused():
    raw = _hf_config("deepseek_v3").to_dict()
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        router_config(raw | {"scoring_func": "softmax"}, "deepseek_v3", EXPERTS, TOP_K)
    assert router_config(raw | {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "deepseek_v3", EXPERTS, TOP_K)
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        router_config(raw | {"n_group": 3}, "deepseek_v3", EXPERTS, TOP_K)
    with pytest.raises(ValueError, match="exceeds"):
        RouterConfig(EXPERTS, 8, topk_method=TopkMethod.NOAUX_TC, n_group=4, topk_group=1)
    v2 = _hf_config("deepseek_v2-greedy").to_dict() | {"topk_method": "group_limited_greedy", "n_group": None}
    with pytest.raises(ValueError, match="needs n_group"):
        router_config(v2, "deepseek_v2", EXPERTS, TOP_K)


MOE_BLOCKS = {"deepseek_v2": "DeepseekV2Moe", "deepseek_v3": "DeepseekV3MoE", "glm4_moe": "Glm4MoeMoE"}


@pytest.mark.parametrize("case", ["deepseek_v2-group_limited_greedy", "deepseek_v3", "glm4_moe"])
def test_moe_block_with_shared_experts_matches_transformers(case):
    """Router, routed experts and the ungated shared experts (n_shared_experts of them fused into one MLP)
    of a DeepSeek/GLM MoE block against transformers' block, on the same weights."""
    module = CASES[case][0]
    hf_cfg = _hf_config(case)
    hf_cfg.n_shared_experts = 2
    block_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), MOE_BLOCKS[module])
    theirs = block_cls(hf_cfg).eval()
    _, router = _pair(case)
    cfg = ModelConfig(
        model_type=module,
        arch=ArchSpec(moe=True, shared_expert=SharedExpert.PLAIN),
        vocab_size=8,
        hidden_size=HIDDEN,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=HIDDEN // 4,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=8,
        router=router.cfg,
        shared_expert_intermediate_size=8 * 2,
        sparse_layers=frozenset({0}),
    )
    ours = MoE(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        ours.gate.load_state_dict(router.state_dict())
        theirs.gate.load_state_dict(router.state_dict())
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up)  # both (E, 2I, D): gate rows, then up rows
        theirs.experts.down_proj.copy_(ours.experts.down)
        gate, up = ours.shared_experts.gate_up_proj.chunk(2)
        theirs.shared_experts.gate_proj.weight.copy_(gate)
        theirs.shared_experts.up_proj.weight.copy_(up)
        theirs.shared_experts.down_proj.weight.copy_(ours.shared_experts.down_proj)
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        ref = theirs(x[None])[0]
        out = ours(x)
        without_shared = ours.experts.forward_reference(x, *ours.route(x))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out - without_shared).abs().max() > 0.1  # the shared experts contribute
