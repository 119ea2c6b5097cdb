"""The CPU router selection kernel (shared/model/kernels/cpu_router.c) against Router's torch ops, which
tests/unit/test_routing.py holds to transformers' routers; and its wiring into the engine."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.kernels import cpu_router
from shared.model.routing import Router, RouterConfig, Scoring, TopkMethod, router_config, use_cpu_router_kernel

LIB = cpu_router.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU router kernel cannot be built on this host")
HIDDEN = 32

# the routers the kernel computes: (model_type, config overrides, experts, top-k)
FITTING = {
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}, 8, 2),
    "qwen2_moe": ("qwen2_moe", {"norm_topk_prob": False}, 60, 4),
    "mixtral": ("mixtral", {}, 8, 2),
    "olmoe": ("olmoe", {"norm_topk_prob": False}, 64, 8),
    "deepseek_v2-greedy": ("deepseek_v2", {"topk_method": "greedy", "routed_scaling_factor": 1.5}, 16, 6),
    "gpt_oss": ("gpt_oss", {}, 32, 4),
}


def _router(model_type: str, overrides: dict, experts: int, top_k: int, seed: int = 0) -> Router:
    router = Router(router_config(overrides, model_type, experts, top_k), HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=gen) / HIDDEN**0.5)
        if router.bias is not None:
            router.bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    return router


@needs_kernel
@pytest.mark.parametrize("case", sorted(FITTING))
def test_kernel_routes_as_the_torch_ops(case):
    """The same experts in the same (descending) order, the same weights to the last bits."""
    router = _router(*FITTING[case])
    assert router.kernel_fits
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        want_ids, want_weights = router(x)
        router.kernel = LIB
        ids, weights = router(x)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == want_ids.shape
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@needs_kernel
def test_equal_logits_choose_the_lower_expert_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    ids, weights = cpu_router.route(LIB, logits, 2, topk_first=False, renormalize=True, scale=1.0)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


@needs_kernel
def test_thread_count_does_not_change_the_result():
    logits = torch.randn(20000, 16, generator=torch.Generator().manual_seed(2))  # enough rows to split
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_router.route(LIB, logits, 4, topk_first=False, renormalize=True, scale=2.5))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))


@needs_kernel
def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        cpu_router.route(LIB, torch.zeros(2, 8, dtype=torch.bfloat16), 2, False, True, 1.0)
    with pytest.raises(ValueError, match="top-9 of 8"):
        cpu_router.route(LIB, torch.zeros(2, 8), 9, False, True, 1.0)
    ids, weights = cpu_router.route(LIB, torch.zeros(0, 8), 2, False, True, 1.0)  # an empty batch
    assert ids.shape == weights.shape == (0, 2)


def test_routers_outside_the_kernel_keep_the_torch_ops():
    grouped = Router(RouterConfig(16, 4, topk_method=TopkMethod.GROUP_LIMITED_GREEDY, n_group=4, topk_group=2), 8)
    sigmoid = Router(RouterConfig(16, 4, scoring=Scoring.SIGMOID), 8)
    biased = Router(router_config({"n_group": 1, "topk_group": 1}, "deepseek_v3", 16, 4), 8)
    model = torch.nn.ModuleList([grouped, sigmoid, biased])
    assert not any(r.kernel_fits for r in model)
    assert "not in the kernel" in use_cpu_router_kernel(model)
    assert all(r.kernel is None for r in model)


def test_missing_compiler_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-pdserve")
    with caplog.at_level(logging.WARNING, logger=cpu_router.__name__):
        assert cpu_router.load.__wrapped__() is None
    assert len([r for r in caplog.records if "torch ops" in r.message]) == 1
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_engine_wires_the_kernel_and_greedy_tokens_match_the_torch_ops(model_dir):
    engine = Engine.from_dir(model_dir, num_kv_blocks=32, max_model_len=128)
    routers = [m for m in engine.model.modules() if isinstance(m, Router)]
    assert routers and all(r.kernel is LIB for r in routers)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_kernel = engine.generate(prompts, params)
    for r in routers:
        r.kernel = None
    assert engine.generate(prompts, params) == with_kernel
