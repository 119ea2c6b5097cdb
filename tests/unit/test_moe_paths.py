"""The grouped MoE paths against the per-token reference: the host-count loop (CPU, packed or plain weights),
the grouped-matmul path (CPU, plain weights) and the sync-free padded path (accelerators), which CPU runs
only here, so its numbers are checked without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.model.config import ARCHITECTURES
from shared.model.kernels import cpu_moe
from shared.model.loader import load_model

MOE_ARCHS = sorted(a for a, spec in ARCHITECTURES.items() if spec.moe)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    model = load_model(write_demo_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param))
    return next(iter(model.sparse_layers().values()))


@pytest.mark.parametrize("num_tokens", [1, 3, 37, 300])  # one token; few experts hit; most; every expert
def test_grouped_and_padded_paths_match_the_reference(moe, num_tokens):
    x = torch.randn(num_tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        ids, weights = moe.route(x)
        counts = torch.bincount(ids.flatten(), minlength=moe.experts.num_experts)
        reference = moe.experts.forward_reference(x, ids, weights)
        grouped = moe.experts.forward_grouped(x, ids, weights, counts.tolist())
        padded = moe.experts.forward_padded(x, ids, weights, counts)
        grouped_mm = moe.experts.forward_grouped_mm(x, ids, weights, counts)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_mm, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_packed_loop_matches_the_reference(moe, num_tokens):
    """The loop over oneDNN-packed expert weights (what prepack_weights gives on CPU) against the plain ones."""
    experts = copy.deepcopy(moe.experts)
    experts.prepack()
    x = torch.randn(num_tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        ids, weights = moe.route(x)
        counts = torch.bincount(ids.flatten(), minlength=experts.num_experts)
        packed = experts.forward_grouped(x, ids, weights, counts.tolist())
        reference = experts.forward_reference(x, ids, weights)
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prepacked", [False, True], ids=["plain", "packed"])
def test_cpu_dispatch_picks_grouped_mm_for_plain_weights(moe, prepacked, monkeypatch):
    """Plain CPU weights take the grouped matmul (no host read of the counts, no loop over experts); packed
    ones the loop, since packed weights cannot be stacked for it."""
    experts = copy.deepcopy(moe.experts)
    if prepacked:
        experts.prepack()
    called = []
    for name in ("forward_grouped", "forward_grouped_mm", "forward_padded"):
        method = getattr(experts, name)
        monkeypatch.setattr(experts, name, lambda *a, _m=method, _n=name: called.append(_n) or _m(*a))
    x = torch.randn(5, moe.gate.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, weights = moe.route(x)
        experts(x, ids, weights, torch.bincount(ids.flatten(), minlength=experts.num_experts))
    assert called == ["forward_grouped" if prepacked else "forward_grouped_mm"]


def test_moe_counts_routed_tokens_on_the_model_device(moe):
    moe.expert_load.zero_()
    x = torch.randn(11, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, _ = moe.route(x)
        moe(x)
    expected = torch.bincount(ids.flatten(), minlength=moe.experts.num_experts)
    assert torch.equal(moe.expert_load, expected)


@pytest.mark.skipif(not cpu_moe.kernels(), reason="the CPU expert kernel cannot be built or run on this host")
@pytest.mark.parametrize("num_tokens", [1, 11, 3000])  # 3000: several CPU_KERNEL_SLICE_TOKENS slices
def test_the_cpu_kernel_counts_routed_tokens_as_bincount_does(moe, num_tokens, monkeypatch):
    """On the CPU expert kernel the per-expert counter is kept by the kernel (no bincount): the same counts,
    accumulated over calls."""
    moe = copy.deepcopy(moe)
    if moe.experts.use_cpu_kernel(cpu_moe.load()) is not None:
        pytest.skip("these experts are not the kernel's")
    monkeypatch.setattr(torch, "bincount", None)  # the kernel path must not count with torch
    moe.expert_load.zero_()
    x = torch.randn(num_tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        ids, _ = moe.route(x)
        moe(x)
        moe(x)
    monkeypatch.undo()
    assert torch.equal(moe.expert_load, 2 * torch.bincount(ids.flatten(), minlength=moe.experts.num_experts))


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_combine_rounds_like_index_add_into_zeros(num_tokens):
    """The combine (outputs put back in routing order, summed over top-k) against the index_add_ it replaced:
    bitwise equal for top-2, an empty batch included."""
    from shared.model.experts import sorted_pairs

    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 16, generator=gen)
    ids = torch.rand(num_tokens, 8, generator=gen).argsort(dim=1)[:, :2]  # two distinct experts per token
    weights = torch.rand(num_tokens, 2, generator=gen)
    pairs = sorted_pairs(x, ids, weights)
    y = torch.randn(num_tokens * 2, 16, generator=gen)
    token = pairs.order // 2
    expected = torch.zeros_like(x).index_add_(0, token, y * weights.flatten()[pairs.order].unsqueeze(1))
    assert torch.equal(pairs.combine(y), expected)
    assert torch.equal(pairs.rows, x[token])
