"""The Triton fused MoE (shared/model/kernels/fused_moe.py) against its torch reference, and the reference
against the model's own `Experts.forward_reference`. Without a GPU the kernels run on CPU tensors under the
Triton interpreter (tests/conftest.py), which runs every program in Python: hence the tiny shapes. On a
CUDA machine the same tests run the compiled kernels on the GPU.

Tolerances: float32 1e-5 (fp32 accumulation on both sides, ieee dots; only summation order differs). float16
1e-2 and bfloat16 5e-2 on O(1) outputs: the kernel rounds h once from fp32 where the reference rounds gate, up
and their product to the low precision each. bfloat16 is skipped under the interpreter (see the test).

Shape legend as in moe.py: T tokens, D hidden, E experts, A experts per token, I expert intermediate size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused MoE kernel cannot be imported")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.model.experts import Experts  # noqa: E402
from shared.model.kernels import fused_moe as fm  # noqa: E402

D, I = 32, 16  # noqa: E741 (the legend's I)


def _device() -> torch.device:
    """CPU under the interpreter (tests/conftest.py sets TRITON_INTERPRET before triton is imported where
    there is no GPU), else the GPU: the same tests then run the compiled kernels."""
    if isinstance(fm._gate_up_kernel, InterpretedFunction):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.fail("triton was imported without TRITON_INTERPRET=1 and there is no GPU: see tests/conftest.py")


DEVICE = _device()


def _weights(e: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up (E, 2I, D), down (E, D, I), scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * I, D, generator=g) / D**0.5
    down = torch.randn(e, D, I, generator=g) / I**0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def _routing(t: int, e: int, a: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token (as top-k picks them), weights normalised over the A picks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(a, dim=-1).indices
    weights = torch.rand(t, a, generator=g) + 0.1
    return ids.to(DEVICE), (weights / weights.sum(dim=-1, keepdim=True)).to(DEVICE)


def _x(t: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, D, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# --- alignment ------------------------------------------------------------------------------------------------


def _check_alignment(blocks, topk_ids: torch.Tensor, e: int, block_m: int) -> None:
    blocks = type(blocks)(*(tensor.cpu() for tensor in blocks))
    flat = topk_ids.flatten().cpu()
    p = flat.numel()
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    n = int(blocks.num_padded.item())
    assert n == int(padded.sum()) and n % block_m == 0
    ids = blocks.sorted_pair_ids
    assert bool((ids[n:] == p).all()), "rows past the padded count are padding"
    used = ids[:n]
    real = used[used < p]
    assert sorted(real.tolist()) == list(range(p)), "every pair appears exactly once"
    assert bool((used <= p).all())
    # one expert per block, in expert order; a block per BM started rows of each non-empty expert, none for the rest
    block_expert = blocks.block_expert_ids[: n // block_m]
    expected_blocks = torch.repeat_interleave(torch.arange(e), padded // block_m)
    assert block_expert.tolist() == expected_blocks.tolist()
    for b, expert in enumerate(block_expert.tolist()):
        rows = used[b * block_m : (b + 1) * block_m]
        pairs = rows[rows < p]
        assert pairs.numel() > 0, f"block {b} holds no pair"
        assert bool((flat[pairs] == expert).all()), f"block {b} mixes experts"
    assert blocks.block_expert_ids.numel() * block_m == ids.numel()
    assert bool((blocks.block_expert_ids < e).all()), "unused blocks still name a real expert"


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize(
    ("t", "e", "a", "route"),
    [(33, 8, 2, "random"), (5, 4, 1, "random"), (1, 4, 2, "random"), (33, 8, 2, "two experts"), (33, 8, 1, "one")],
)
def test_align_pairs(t: int, e: int, a: int, route: str, block_m: int) -> None:
    ids = _routing(t, e, a)[0]
    if route == "two experts":
        ids = torch.tensor([[5, 2]], device=DEVICE).expand(t, a).contiguous()
    elif route == "one":
        ids = torch.full((t, a), 3, device=DEVICE)
    _check_alignment(fm.align_pairs(ids, e, block_m), ids, e, block_m)


def test_align_pairs_reads_nothing_on_the_host() -> None:
    """On the meta device a tensor has no values: any host read (.item(), .tolist(), bincount's max) raises.
    So this proves the alignment never syncs with the device it runs on."""
    ids = torch.empty(33, 2, dtype=torch.int64, device="meta")
    blocks = fm.align_pairs(ids, 8, 16)
    bound = fm.max_blocks(66, 8, 16)
    assert bound == 12  # 66 pairs + 8 experts * 15 padding rows → ceil(186 / 16)
    assert blocks.sorted_pair_ids.shape == (bound * 16,) and blocks.block_expert_ids.shape == (bound,)
    assert blocks.num_padded.shape == (1,)


# --- the kernel against the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("a", [1, 2])
@pytest.mark.parametrize("e", [4, 8])
def test_fused_moe_matches_reference_fp32(e: int, a: int, t: int) -> None:
    gate_up, down = _weights(e)
    ids, weights = _routing(t, e, a)
    x = _x(t)
    ref = fm.fused_moe_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(fm.fused_moe(x, gate_up, down, ids, weights), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("a", "experts"), [(2, [5, 2]), (1, [3])], ids=["all tokens to two experts", "all tokens to one expert"]
)
def test_fused_moe_with_empty_experts(a: int, experts: list[int]) -> None:
    """Six or seven of eight experts get no token (so no block); the others get every token."""
    t, e = 33, 8
    gate_up, down = _weights(e)
    ids = torch.tensor([experts], device=DEVICE).expand(t, a).contiguous()
    weights = _routing(t, e, a)[1]
    x = _x(t)
    ref = fm.fused_moe_reference(x, gate_up, down, ids, weights)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(fm.fused_moe(x, gate_up, down, ids, weights), ref, rtol=1e-5, atol=1e-5)


def test_fused_moe_honours_strides() -> None:
    """x a strided view (every other column of a wider tensor) and int32 ids: same result as contiguous int64."""
    t, e, a = 5, 4, 2
    gate_up, down = _weights(e)
    ids, weights = _routing(t, e, a)
    wide = torch.randn(t, 2 * D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    ref = fm.fused_moe_reference(x.contiguous(), gate_up, down, ids, weights)
    out = fm.fused_moe(x, gate_up, down, ids.to(torch.int32), weights)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fused_moe_fp16() -> None:
    t, e, a = 33, 8, 2
    gate_up, down = _weights(e, torch.float16)
    ids, weights = _routing(t, e, a)
    x = _x(t, torch.float16)
    out = fm.fused_moe(x, gate_up, down, ids, weights)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, fm.fused_moe_reference(x, gate_up, down, ids, weights), rtol=1e-2, atol=1e-2)


def _interpreter_dots_bf16() -> bool:
    """triton 3.7.1's interpreter multiplies bf16 tiles as their raw uint16 bits (numpy has no bfloat16)."""
    x = torch.eye(16, D, dtype=torch.bfloat16, device=DEVICE)
    gate_up, down = _weights(1, torch.bfloat16)
    ids, weights = torch.zeros(16, 1, dtype=torch.int64, device=DEVICE), torch.ones(16, 1, device=DEVICE)
    out = fm.fused_moe(x, gate_up, down, ids, weights)
    return bool(out.float().abs().max() < 1e3)


def test_fused_moe_bf16() -> None:
    if not _interpreter_dots_bf16():
        pytest.skip("the Triton interpreter cannot multiply bf16 tiles (raw bits); bf16 is checked on a GPU")
    t, e, a = 33, 8, 2
    gate_up, down = _weights(e, torch.bfloat16)
    ids, weights = _routing(t, e, a)
    x = _x(t, torch.bfloat16)
    ref = fm.fused_moe_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(fm.fused_moe(x, gate_up, down, ids, weights), ref, rtol=5e-2, atol=5e-2)


def test_fused_moe_rejects_mismatched_inputs() -> None:
    gate_up, down = _weights(4)
    ids, weights = _routing(5, 4, 2)
    with pytest.raises(ValueError, match="do not fit"):
        fm.fused_moe(_x(5)[:, :16], gate_up, down, ids, weights)
    with pytest.raises(ValueError, match="need"):
        fm.fused_moe(_x(5), gate_up, down, ids[:4], weights[:4, :1])
    with pytest.raises(ValueError, match="bfloat16"):
        fm.fused_moe(_x(5), gate_up.bfloat16(), down, ids, weights)


def test_fused_moe_no_tokens() -> None:
    gate_up, down = _weights(4)
    ids, weights = torch.empty(0, 2, dtype=torch.int64, device=DEVICE), torch.empty(0, 2, device=DEVICE)
    out = fm.fused_moe(torch.empty(0, D, device=DEVICE), gate_up, down, ids, weights)
    assert out.shape == (0, D)


# --- the reference against the model ----------------------------------------------------------------------------


@pytest.mark.parametrize(("e", "a", "t"), [(8, 2, 5), (4, 1, 33)])
def test_reference_matches_model_experts(e: int, a: int, t: int) -> None:
    """fused_moe_reference is the math of experts.Experts.forward_reference, so the kernel is held to the model."""
    experts = Experts(e, D, I).to(DEVICE)
    gate_up, down = _weights(e, seed=7)
    with torch.no_grad():
        experts.gate_up.copy_(gate_up)
        experts.down.copy_(down)
        ids, weights = _routing(t, e, a, seed=8)
        x = _x(t, seed=9)
        model = experts.forward_reference(x, ids, weights)
    assert model.abs().max() > 0.1
    torch.testing.assert_close(fm.fused_moe_reference(x, gate_up, down, ids, weights), model, rtol=1e-5, atol=1e-6)
