"""The CPU expert kernel (shared/model/kernels/cpu_moe.c) against the torch paths of shared/model/experts.py."""

from __future__ import annotations

import logging
import math
from typing import cast

import pytest
import torch

from shared.model import experts as experts_module
from shared.model.experts import Experts
from shared.model.kernels import cpu_moe
from shared.model.moe import use_cpu_expert_kernel

LIB = cpu_moe.load()  # the widest build this host runs
BUILDS = cpu_moe.kernels()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU expert kernel cannot be built or run on this host")
# every build this host runs, one case each (none: the cases skip)
each_build = pytest.mark.parametrize(
    "build", BUILDS or [pytest.param(None, marks=needs_kernel)], ids=lambda b: b.isa if b else "none"
)


def _experts(num_experts: int, hidden: int, intermediate: int, seed: int = 0) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, hidden, intermediate)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=gen) * 0.2)
        experts.down.copy_(torch.randn(experts.down.shape, generator=gen) * 0.2)
    return experts


def _routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator, only: int | None = None):
    """→ (ids (T, A) int64, weights (T, A) float32): distinct experts per token, drawn from the first `only`."""
    pool = only or num_experts
    ids = torch.rand(tokens, pool, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen).softmax(dim=1)
    return ids, weights


@each_build
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("hidden,intermediate", [(64, 48), (32, 16)])
def test_kernel_matches_torch_for_every_row_count(build, top_k, hidden, intermediate):
    """Rows 1..33 cover every register tile (1-6 rows in the AVX2 build, 1-12 in the AVX-512 one) and the
    balanced splits; with 8 experts and few tokens most experts get none."""
    experts = _experts(8, hidden, intermediate)
    assert experts.use_cpu_kernel(build) is None
    gen = torch.Generator().manual_seed(top_k)
    for tokens in range(1, 34):
        x = torch.randn(tokens, hidden, generator=gen)
        ids, weights = _routing(tokens, 8, top_k, gen)
        counts = torch.bincount(ids.flatten(), minlength=8)
        with torch.inference_mode():
            kernel = experts.forward_cpu_kernel(x, ids, weights)
            torch_path = experts.forward_grouped_mm(x, ids, weights, counts)
        torch.testing.assert_close(kernel, torch_path, rtol=1e-5, atol=1e-5)
        if tokens in (1, 7, 33):  # the per-token reference is slow: a few row counts
            with torch.inference_mode():
                reference = experts.forward_reference(x, ids, weights)
            torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


@each_build
def test_kernel_with_empty_experts_and_one_expert_taking_every_token(build):
    experts = _experts(8, 32, 16)
    assert experts.use_cpu_kernel(build) is None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 32, generator=gen)
    for only in (1, 2, 3):  # experts 0..only-1 get every pair; the rest none
        ids, weights = _routing(33, 8, 1 if only == 1 else 2, gen, only=only)
        with torch.inference_mode():
            kernel = experts.forward_cpu_kernel(x, ids, weights)
            reference = experts.forward_reference(x, ids, weights)
        torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_forward_takes_the_kernel_for_every_batch_in_slices_that_change_no_bits(monkeypatch):
    experts = _experts(4, 32, 16)
    experts.prepack()
    assert LIB is not None and experts.use_cpu_kernel(LIB) is None
    assert experts._packed is None  # the panels replace the oneDNN packs
    monkeypatch.setattr(experts_module, "CPU_KERNEL_SLICE_TOKENS", 8)
    called = []
    moe_call = cpu_moe.Kernel.moe
    monkeypatch.setattr(cpu_moe.Kernel, "moe", lambda k, x, *a, **kw: called.append(len(x)) or moe_call(k, x, *a, **kw))
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 8, 21):  # a decode batch, one slice, a prefill of three slices (8 + 8 + 5)
        x = torch.randn(tokens, 32, generator=gen)
        ids, weights = _routing(tokens, 4, 2, gen)
        with torch.inference_mode():
            out = experts(x, ids, weights, torch.bincount(ids.flatten(), minlength=4))
            whole = moe_call(LIB, x, ids, weights, experts._panels)  # one call over every token
        torch.testing.assert_close(out, experts.forward_reference(x, ids, weights), rtol=1e-5, atol=1e-5)
        assert torch.equal(out, whole)
    assert called == [1, 8, 8, 8, 5]


def _unloaded(isa: str) -> cpu_moe.Kernel:
    """A build whose library is never called: every case given it is refused before the library is used."""
    return cpu_moe.Kernel(cast(cpu_moe.ctypes.CDLL, None), isa, {"avx2": 8, "avx512": 16, "avx512bf16": 16}[isa])


def test_kernel_refuses_what_it_cannot_compute():
    avx2, avx512 = _unloaded("avx2"), _unloaded("avx512")
    assert "float32, bfloat16 and int8" in (_experts(2, 16, 8).to(torch.float16).use_cpu_kernel(avx2) or "")
    assert "multiple" in (_experts(2, 24, 8).use_cpu_kernel(avx2) or "")  # hidden not a multiple of 16
    assert "multiple" in (_experts(2, 16, 12).use_cpu_kernel(avx2) or "")  # intermediate not a multiple of 8
    assert "avx512" in (_experts(2, 48, 16).use_cpu_kernel(avx512) or "")  # hidden not a multiple of 32
    assert "avx512" in (_experts(2, 32, 8).use_cpu_kernel(avx512) or "")  # intermediate not a multiple of 16
    from shared.model.clamped_experts import ClampedSwiGLUExperts

    clamped = ClampedSwiGLUExperts(2, 16, 8, alpha=1.702, limit=7.0)
    assert clamped.use_cpu_kernel(avx2) is not None and clamped._panels is None


@pytest.mark.skipif(len(BUILDS) < 2, reason="this host runs one build of the kernel")
def test_a_layer_the_wide_build_refuses_takes_the_narrow_one():
    """hidden 48 divides AVX2's 16-column down panels but not AVX-512's 32: that layer runs the AVX2 build."""
    model = torch.nn.ModuleList([_experts(4, 64, 16), _experts(4, 48, 16)])
    line = use_cpu_expert_kernel(model)
    assert f"{BUILDS[0].isa} in 1/2 layers" in line and "avx2 in 1/2 layers" in line and "torch" not in line, line
    wide, narrow = cast(Experts, model[0]), cast(Experts, model[1])
    assert wide._cpu_kernel is BUILDS[0] and narrow._cpu_kernel is not None and narrow._cpu_kernel.isa == "avx2"


def test_missing_compiler_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-pdserve")
    with caplog.at_level(logging.WARNING, logger=cpu_moe.__name__):
        assert cpu_moe.kernels.__wrapped__() == ()
    assert [r.message for r in caplog.records if "torch path" in r.message] != []
    assert list(tmp_path.iterdir()) == []  # nothing half-built left in the cache


@needs_kernel
def test_each_isa_is_a_library_of_its_own(tmp_path):
    """The build cache itself: tests/unit/test_cbuild.py."""
    assert cpu_moe._build(cpu_moe.SOURCE, tmp_path, "avx512") != cpu_moe._build(cpu_moe.SOURCE, tmp_path)


@needs_kernel
def test_the_isa_setting_picks_one_build(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNEL_ISA", "avx2")
    assert [k.isa for k in cpu_moe.kernels.__wrapped__()] == ["avx2"]
    monkeypatch.setenv("PDSERVE_CPU_KERNEL_ISA", "sse2")
    with pytest.raises(ValueError, match="avx512bf16, avx512, avx2"):
        cpu_moe.kernels.__wrapped__()


@pytest.mark.skipif(len(BUILDS) < 2, reason="this host runs one build of the kernel")
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_every_build_gives_the_same_bits(top_k):
    """The builds add the same products in the same order with the same operations: bitwise equal for every
    row count 1..40 (12- and 6-row tiles split rows differently; each row's sums do not depend on its tile)."""
    experts = _experts(8, 64, 48, seed=top_k)
    panels = [build.pack(experts.gate_up.data, experts.down.data) for build in BUILDS]
    gen = torch.Generator().manual_seed(20 + top_k)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 64, generator=gen)
        ids, weights = _routing(tokens, 8, top_k, gen)
        with torch.inference_mode():
            first, *rest = (build.moe(x, ids, weights, p) for build, p in zip(BUILDS, panels, strict=True))
        assert all(torch.equal(first, other) for other in rest), tokens


@each_build
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_one_two_and_three_threads_give_the_same_bits(build, top_k):
    """Threads split (expert, panel) tiles and each token's row is combined by one thread in expert order, so
    the result may not depend on the thread count: bitwise equal at 1, 2 and 3 threads, and within tolerance
    of the torch reference, for every row count 1..40, including one expert taking every pair."""
    experts = _experts(8, 64, 48, seed=top_k)
    assert experts.use_cpu_kernel(build) is None
    panels = experts._panels
    assert panels is not None
    gen = torch.Generator().manual_seed(10 + top_k)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 64, generator=gen)
        only = 1 if top_k == 1 and tokens % 5 == 0 else None  # every fifth: all pairs on expert 0
        ids, weights = _routing(tokens, 8, top_k, gen, only=only)
        with torch.inference_mode():
            one, two, three = (build.moe(x, ids, weights, panels, threads=n) for n in (1, 2, 3))
            torch_path = experts.forward_grouped_mm(x, ids, weights, torch.bincount(ids.flatten(), minlength=8))
        assert torch.equal(one, two) and torch.equal(one, three), tokens
        torch.testing.assert_close(two, torch_path, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_kernel_takes_torchs_thread_count():
    """threads=None means torch.get_num_threads(): the engine's intra-op count reaches the kernel."""
    experts = _experts(4, 32, 16)
    assert LIB is not None and experts.use_cpu_kernel(LIB) is None
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=gen)
    ids, weights = _routing(16, 4, 2, gen)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                out = experts.forward_cpu_kernel(x, ids, weights)
            torch.testing.assert_close(out, experts.forward_reference(x, ids, weights), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@each_build
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16], ids=["f32-weights", "bf16-weights"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_bfloat16_kernel_matches_torchs_bfloat16_path(build, weights_dtype, top_k):
    """A bfloat16 model's experts: bfloat16 activations and weights, float32 accumulation, rounded to bfloat16
    where torch's bfloat16 linear, silu, multiply and weighted sum round; routing weights in bfloat16 (Qwen-MoE,
    OLMoE) or float32 (Mixtral). Tolerance, the model parity tests' (test_model_parity_bf16.py): max |diff| ≤ 2
    bfloat16 ulps of the output's largest magnitude. Measured: 99.98% of the elements bitwise equal to torch's
    grouped path; the rest part where a float32 sum in another order rounds h to the neighbouring bfloat16."""
    experts = _experts(8, 64, 48, seed=top_k).to(torch.bfloat16)
    assert experts.use_cpu_kernel(build) is None and experts._panels is not None
    assert experts._panels.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(40 + top_k)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 64, generator=gen).bfloat16()
        ids, weights = _routing(tokens, 8, top_k, gen)
        weights = weights.to(weights_dtype)
        with torch.inference_mode():
            kernel = experts.forward_cpu_kernel(x, ids, weights)
            torch_path = experts.forward_grouped_mm(x, ids, weights, torch.bincount(ids.flatten(), minlength=8))
        assert kernel.dtype == torch.bfloat16
        references = [torch_path]
        if tokens in (1, 9, 40):
            with torch.inference_mode():
                references.append(experts.forward_reference(x, ids, weights))
        for reference in references:
            ulp = 2.0 ** (math.floor(math.log2(reference.abs().max().item())) - 7)
            assert (kernel.float() - reference.float()).abs().max().item() <= 2 * ulp, tokens


@pytest.mark.skipif(len(BUILDS) < 2, reason="this host runs one build of the kernel")
def test_every_build_gives_the_same_bfloat16_bits():
    """VDPBF16PS (the avx512bf16 build) and the converting builds' two FMAs per pair, odd element first: the same
    float32 sums, hence the same bits (no denormals at these magnitudes, which VDPBF16PS would flush)."""
    experts = _experts(8, 64, 48, seed=9).to(torch.bfloat16)
    panels = [build.pack(experts.gate_up.data, experts.down.data) for build in BUILDS]
    gen = torch.Generator().manual_seed(50)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 64, generator=gen).bfloat16()
        ids, weights = _routing(tokens, 8, 4, gen)
        with torch.inference_mode():
            first, *rest = (build.moe(x, ids, weights, p) for build, p in zip(BUILDS, panels, strict=True))
        assert all(torch.equal(first, other) for other in rest), tokens
