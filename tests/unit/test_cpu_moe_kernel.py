"""The CPU expert kernel (shared/model/kernels/cpu_moe.c) against the torch paths of shared/model/moe.py."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.model.kernels import cpu_moe
from shared.model.moe import CPU_KERNEL_MAX_TOKENS, Experts

LIB = cpu_moe.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU expert kernel cannot be built or run on this host")


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


@needs_kernel
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("hidden,intermediate", [(32, 24), (48, 8)])
def test_kernel_matches_torch_for_every_row_count(top_k, hidden, intermediate):
    """Rows 1..33 cover every register tile (1-6 rows) and the balanced splits; with 8 experts and few tokens
    most experts get none."""
    experts = _experts(8, hidden, intermediate)
    assert experts.use_cpu_kernel(LIB) is None
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


@needs_kernel
def test_kernel_with_empty_experts_and_one_expert_taking_every_token():
    experts = _experts(8, 32, 16)
    experts.use_cpu_kernel(LIB)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 32, generator=gen)
    for only in (1, 2, 3):  # experts 0..only-1 get every pair; the rest none
        ids, weights = _routing(33, 8, 1 if only == 1 else 2, gen, only=only)
        with torch.inference_mode():
            kernel = experts.forward_cpu_kernel(x, ids, weights)
            reference = experts.forward_reference(x, ids, weights)
        torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_forward_takes_the_kernel_for_decode_batches_only(monkeypatch):
    experts = _experts(4, 16, 8)
    experts.prepack()
    assert experts.use_cpu_kernel(LIB) is None
    assert experts._packed is None  # the panels replace the oneDNN packs
    called = []
    kernel = experts.forward_cpu_kernel
    monkeypatch.setattr(experts, "forward_cpu_kernel", lambda *a: called.append(a[0].shape[0]) or kernel(*a))
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, CPU_KERNEL_MAX_TOKENS, CPU_KERNEL_MAX_TOKENS + 1):
        x = torch.randn(tokens, 16, generator=gen)
        ids, weights = _routing(tokens, 4, 2, gen)
        with torch.inference_mode():
            out = experts(x, ids, weights, torch.bincount(ids.flatten(), minlength=4))
        torch.testing.assert_close(out, experts.forward_reference(x, ids, weights), rtol=1e-5, atol=1e-5)
    assert called == [1, CPU_KERNEL_MAX_TOKENS]


def test_kernel_refuses_what_it_cannot_compute():
    lib = object()  # never called: every case is refused before the library is used
    assert "float32" in (_experts(2, 16, 8).to(torch.bfloat16).use_cpu_kernel(lib) or "")
    assert "multiple" in (_experts(2, 24, 8).use_cpu_kernel(lib) or "")  # hidden not a multiple of 16
    assert "multiple" in (_experts(2, 16, 12).use_cpu_kernel(lib) or "")  # intermediate not a multiple of 8
    from shared.model.clamped_experts import ClampedSwiGLUExperts

    clamped = ClampedSwiGLUExperts(2, 16, 8, alpha=1.702, limit=7.0)
    assert clamped.use_cpu_kernel(lib) is not None and clamped._panels is None


def test_missing_compiler_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-pdserve")
    with caplog.at_level(logging.WARNING, logger=cpu_moe.__name__):
        assert cpu_moe.load.__wrapped__() is None
    assert [r.message for r in caplog.records if "torch path" in r.message] != []
    assert list(tmp_path.iterdir()) == []  # nothing half-built left in the cache


@needs_kernel
def test_build_is_cached_by_source_hash(tmp_path):
    first = cpu_moe._build(cpu_moe.SOURCE, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_moe._build(cpu_moe.SOURCE, tmp_path) == first and first.stat().st_mtime_ns == mtime
    edited = tmp_path / "cpu_moe.c"
    edited.write_text(cpu_moe.SOURCE.read_text() + "\n/* edited */\n")
    assert cpu_moe._build(edited, tmp_path) != first


@needs_kernel
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_one_two_and_three_threads_give_the_same_bits(top_k):
    """Threads split (expert, panel) tiles and each token's row is combined by one thread in expert order, so
    the result may not depend on the thread count: bitwise equal at 1, 2 and 3 threads, and within tolerance
    of the torch reference, for every row count 1..40, including one expert taking every pair."""
    experts = _experts(8, 48, 40, seed=top_k)
    assert experts.use_cpu_kernel(LIB) is None
    lib, panels = LIB, experts._panels
    assert lib is not None and panels is not None
    gen = torch.Generator().manual_seed(10 + top_k)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 48, generator=gen)
        only = 1 if top_k == 1 and tokens % 5 == 0 else None  # every fifth: all pairs on expert 0
        ids, weights = _routing(tokens, 8, top_k, gen, only=only)
        with torch.inference_mode():
            one, two, three = (cpu_moe.moe(lib, x, ids, weights, panels, threads=n) for n in (1, 2, 3))
            torch_path = experts.forward_grouped_mm(x, ids, weights, torch.bincount(ids.flatten(), minlength=8))
        assert torch.equal(one, two) and torch.equal(one, three), tokens
        torch.testing.assert_close(two, torch_path, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_kernel_takes_torchs_thread_count():
    """threads=None means torch.get_num_threads(): the engine's intra-op count reaches the kernel."""
    experts = _experts(4, 32, 16)
    experts.use_cpu_kernel(LIB)
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
