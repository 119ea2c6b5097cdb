"""Dense float32 linears on the CPU kernel's panels (shared/model/panel_linear.py) against torch's GEMM, and the
router on the panels: scores whose bits do not depend on the batch (shared/model/routing.py).

Tolerance: the panel kernel sums each output's K products in order, oneDNN/MKL in their blocking, so the two
agree up to float32 summation order: rtol 1e-5, atol 1e-5 on unit-scale data (the int8 linears' bound,
tests/unit/test_int8.py). Greedy tokens against transformers with the panels on are test_model_parity.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.kernel_setup import prepare_model
from shared.engine.sampling import SamplingParams
from shared.model import routing
from shared.model.kernels import cpu_moe
from shared.model.linear import can_prepack
from shared.model.loader import load_model
from shared.model.panel_linear import PanelLinear, use_panel_linears
from shared.model.router_config import RouterConfig, Scoring

BUILDS = cpu_moe.kernels()
needs_kernel = pytest.mark.skipif(not BUILDS, reason="the CPU kernel library cannot be built or run on this host")
each_build = pytest.mark.parametrize(
    "build", BUILDS or [pytest.param(None, marks=needs_kernel)], ids=lambda b: b.isa if b else "none"
)


@each_build
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 31, 32])
@pytest.mark.parametrize("short", [0, 5], ids=["whole-panels", "padded"])  # outputs short of whole panels
def test_panel_linear_matches_torchs_gemm(build, rows, short):
    gen = torch.Generator().manual_seed(rows)
    n = 4 * build.lanes - short
    weight = torch.randn(n, 80, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    served = PanelLinear.pack(build, weight)
    x = torch.randn(rows, 80, generator=gen)
    out = served.matmul(x)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(served.matmul(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    x3 = x.view(1, rows, 80)  # leading dims kept
    assert torch.equal(served.matmul(x3), out.view(1, rows, n))


@needs_kernel
def test_panel_linear_gives_the_same_bits_at_any_thread_count_and_build():
    build = BUILDS[0]
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen)
    x = torch.randn(29, 64, generator=gen)
    ref = build.linear_f32(x, PanelLinear.pack(build, weight).panels, threads=1)
    for threads in (2, 3):
        assert torch.equal(build.linear_f32(x, PanelLinear.pack(build, weight).panels, threads=threads), ref)
    for other in BUILDS[1:]:  # narrower vectors, the same products in the same order
        assert torch.equal(other.linear_f32(x, PanelLinear.pack(other, weight).panels, threads=1), ref)


@needs_kernel
@pytest.mark.parametrize("rows", [64, 300])
def test_prefill_sized_batches_match_torchs_gemm(rows):
    build = BUILDS[0]
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3 * build.lanes, 96, generator=gen) * 0.1
    x = torch.randn(rows, 96, generator=gen)
    torch.testing.assert_close(PanelLinear.pack(build, weight).matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_panels_serve_the_dense_projections_only(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")

    def panel_served(cpu_linear_kernel: bool) -> set[tuple[str, str]]:
        model = load_model(ckpt)
        config = EngineConfig(model=str(ckpt), cpu_linear_kernel=cpu_linear_kernel)
        prepare_model(model, config, torch.device("cpu"))
        served = {
            (type(m).__name__, name)
            for m in model.modules()
            for name, f in (m.__dict__.get("_formats") or {}).items()
            if isinstance(f, PanelLinear)
        }
        packed = {(type(m).__name__, name) for m in model.modules() for name in m.__dict__.get("_packed") or {}}
        assert not served & packed  # the panels replace the oneDNN pack: one copy beside the parameter
        assert (("Router", "weight") in packed) != cpu_linear_kernel  # prepacking packs what the panels do not serve
        return served

    served = panel_served(True)
    # the router too: its scores keep their bits whatever the batch (test_a_tokens_router_scores_...)
    assert {("Attention", "qkv_proj"), ("Attention", "o_proj"), ("Router", "weight")} <= served
    assert not any(kind == "MoE" for kind, _ in served)  # the routed experts have a kernel of their own
    assert panel_served(False) == set()


@needs_kernel
def test_engine_tokens_with_and_without_the_panels_agree(tmp_path):
    """Greedy decoding on the tiny checkpoint: the panel linears (different summation order) keep the tokens of
    the torch path (transformers' parity, with the panels on, is test_model_parity.py's)."""
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (5, 37)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for on in (True, False):
        engine = Engine.from_dir(ckpt, num_kv_blocks=32, max_model_len=128, cpu_linear_kernel=on)
        served = [f for m in engine.model.modules() for f in (m.__dict__.get("_formats") or {}).values()]
        assert any(isinstance(f, PanelLinear) for f in served) == on
        outs.append(engine.generate(prompts, params))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("panels", [False, pytest.param(True, marks=needs_kernel)], ids=["packed", "panels"])
@pytest.mark.parametrize(("experts", "hidden"), [(8, 64), (128, 2048)], ids=["demo", "qwen3-30b-a3b"])
def test_a_tokens_router_scores_do_not_depend_on_its_batch(experts, hidden, panels):
    """The scores decide a token's experts: the same bits whether it is scored alone, in a decode batch or in a
    prompt chunk of any size (a chunked, layer-streamed or recomputed prompt must route as the whole one did). A
    plain-weight path for small batches broke this (tests/integration/test_kv_layer_stream.py saw the last layer's
    KV of a 12-token last chunk differ by 1e-6); oneDNN's packed GEMM breaks it at a real router's shape (a lone
    token's scores), so a float32 engine serves the router on the panel linear (what prepare_model does)."""
    cfg = RouterConfig(num_experts=experts, top_k=2, scoring=Scoring.SOFTMAX, norm_topk_prob=True)
    router = routing.Router(cfg, hidden)
    torch.nn.init.normal_(router.weight, std=0.1)
    if panels:
        assert use_panel_linears(router, BUILDS[0]).startswith("1/1 ")
        assert isinstance(router.w("weight"), PanelLinear)
    elif experts > 8 or not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("the packed router keeps this property only at the demo's shape (or cannot pack here)")
    router.prepack()  # packs nothing the panels serve
    x = torch.randn(128, hidden, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = router.logits(x)
        for rows in (1, 2, 12, 16, 17, 44):
            assert torch.equal(router.logits(x[:rows]), whole[:rows]), rows
        if panels:  # and routes as the plain weight: the same experts, weights up to summation order (2048 terms)
            plain_ids, plain_weights = routing.Router.forward(_plain(router), x)
            ids, weights = router(x)
            assert torch.equal(ids, plain_ids)
            torch.testing.assert_close(weights, plain_weights, rtol=1e-4, atol=1e-5)


def _plain(router: routing.Router) -> routing.Router:
    """A twin of `router` serving its plain parameter (no format, no pack)."""
    twin = routing.Router(router.cfg, router.in_features)
    twin.load_state_dict(router.state_dict())
    return twin


@needs_kernel
def test_a_router_with_a_logit_bias_keeps_its_fused_bias():
    """gpt-oss's router adds a bias: the panel would add it after the product (one more rounding than
    transformers' fused bias), so that router is not put on panels."""
    cfg = RouterConfig(num_experts=8, top_k=2, scoring=Scoring.SOFTMAX, norm_topk_prob=True, logit_bias=True)
    router = routing.Router(cfg, 64)
    assert use_panel_linears(router, BUILDS[0]).startswith("0/0 ") and isinstance(router.w("weight"), torch.Tensor)
