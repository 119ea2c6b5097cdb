"""The Triton paged decode-attention kernel against its torch reference, and the reference against the model's
decode path (shared/model/paged_attention.py). Without a GPU it runs on CPU tensors under TRITON_INTERPRET=1
(set by tests/conftest.py), every program in Python: hence the tiny shapes. On a CUDA machine the same
tests run the compiled kernels on the GPU.

Tolerances: float32 is held to 1e-5 (both sides accumulate in fp32; only summation order differs). Low
precision: kernel and reference both compute in fp32 and round once at the end, so they differ by at most one
unit in the last place. float16 is held to 4e-3; bfloat16 to 2e-2, because triton 3.7.1's interpreter
truncates fp32 -> bf16 instead of rounding to nearest (measured: its outputs equal the truncated fp32 values),
a full bf16 ulp (2**-7 relative) where the reference is off by at most half of one.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the kernel cannot be built or interpreted")

from shared.model.paged_attention import AttentionMetadata, paged_attention  # noqa: E402

SCALE = 0.3


def _device() -> torch.device:
    """CPU under the interpreter (tests/conftest.py sets it where no GPU is present), else the GPU."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.fail("triton was imported without TRITON_INTERPRET=1 and there is no GPU: see tests/conftest.py")


DEVICE = _device()
from shared.model.kernels import paged_decode_attention as kernels  # noqa: E402


def _batch(
    group: int,
    block_size: int,
    head_dim: int,
    context_lens: list[int],
    dtype: torch.dtype = torch.float32,
    table_dtype: torch.dtype = torch.int32,
    kv_heads: int = 2,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, kv_cache, block_tables, context_lens with blocks scattered over a pool whose every slot outside
    the sequences' contexts holds NaN: a kernel that reads one unmasked slot outside a context returns NaN."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens) + 1  # one spare column: tables are wider than needed
    num_blocks = len(context_lens) * width + 3
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), math.nan)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(context_lens) * width].view(len(context_lens), width)
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    for row, n in zip(tables, context_lens, strict=True):
        pos = torch.arange(n)
        slots = row[pos // block_size] * block_size + pos % block_size
        flat[:, slots] = torch.randn(2, n, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=gen)
    lens = torch.tensor(context_lens, device=DEVICE)
    return q.to(DEVICE, dtype), kv_cache.to(DEVICE, dtype), tables.to(DEVICE, table_dtype), lens


def _ragged_lens(block_size: int) -> list[int]:
    # 1 token; exactly one block; a partial third block; exactly five blocks (the longest).
    return [1, block_size, 2 * block_size + 3, 5 * block_size]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "split-k"])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda g: f"gqa{g}")
def test_kernel_matches_reference_float32(group, block_size, head_dim, num_splits):
    q, kv_cache, tables, lens = _batch(group, block_size, head_dim, _ragged_lens(block_size))
    got = kernels.paged_decode_attention(q, kv_cache, tables, lens, SCALE, num_splits=num_splits)
    want = kernels.paged_decode_attention_reference(q, kv_cache, tables, lens, SCALE)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not want.isnan().any()  # the reference never reads the NaN slots either
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "split-k"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)], ids=["bfloat16", "float16"])
def test_kernel_matches_reference_low_precision(dtype, tol, num_splits):
    q, kv_cache, tables, lens = _batch(2, 16, 32, _ragged_lens(16), dtype=dtype, table_dtype=torch.int64)
    got = kernels.paged_decode_attention(q, kv_cache, tables, lens, SCALE, num_splits=num_splits)
    want = kernels.paged_decode_attention_reference(q, kv_cache, tables, lens, SCALE)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_odd_head_dim_and_strided_query():
    """A head dim that is not a power of two (padded lanes masked) and q as a slice of a wider tensor."""
    q, kv_cache, tables, lens = _batch(2, 8, 24, [5, 17, 40])
    wide = torch.zeros(q.shape[0], q.shape[1], 40, device=DEVICE)
    wide[..., 8:32] = q
    strided = wide[..., 8:32]
    assert not strided.is_contiguous()
    for splits in (1, 4):
        got = kernels.paged_decode_attention(strided, kv_cache, tables, lens, SCALE, num_splits=splits)
        want = kernels.paged_decode_attention_reference(q, kv_cache, tables, lens, SCALE)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_default_split_count_splits_long_contexts():
    lens = [600, 3, 300]
    q, kv_cache, tables, context_lens = _batch(1, 32, 16, lens, kv_heads=1)
    assert kernels.choose_num_splits(3, 1, tables.shape[1], 32, max(lens)) == 3  # 600 tokens / 256 per split
    got = kernels.paged_decode_attention(q, kv_cache, tables, context_lens, SCALE, max_context_len=max(lens))
    want = kernels.paged_decode_attention_reference(q, kv_cache, tables, context_lens, SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # More splits than blocks: clamped to one block per split.
    got = kernels.paged_decode_attention(q, kv_cache, tables, context_lens, SCALE, num_splits=10_000)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_choose_num_splits():
    choose = kernels.choose_num_splits
    assert choose(batch=4, kv_heads=2, max_blocks=16, block_size=16, max_context_len=200) == 1  # short
    assert choose(batch=1, kv_heads=1, max_blocks=1024, block_size=16, max_context_len=16384) == kernels.MAX_SPLITS
    assert choose(batch=256, kv_heads=8, max_blocks=1024, block_size=16, max_context_len=16384) == 1  # GPU full
    assert choose(batch=32, kv_heads=2, max_blocks=1024, block_size=16, max_context_len=16384) == 4  # 256 // 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 12}, "power of two"),
        ({"heads": 3}, "do not fit"),
        ({"num_splits": 0}, "num_splits"),
    ],
)
def test_rejects_bad_arguments(change, message):
    block_size = change.get("block_size", 8)
    q = torch.zeros(1, change.get("heads", 4), 16)
    kv_cache = torch.zeros(2, 4, block_size, 2, 16)
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode_attention(
            q, kv_cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3]), SCALE,
            num_splits=change.get("num_splits"),
        )  # fmt: skip


@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda g: f"gqa{g}")
def test_reference_and_kernel_match_the_model_decode_path(group):
    """paged_attention with a decode-only batch writes this step's K/V, then attends; the reference and the
    kernel, run over the cache after that write, give what the model computes today."""
    block_size, kv_heads, head_dim = 8, 2, 16
    lens = [1, 8, 19, 9]
    tables = [[3, 7, 1], [0, 9], [2, 4, 6, 11], [5, 8]]
    gen = torch.Generator().manual_seed(group)
    kv_cache = torch.randn(2, 12, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    k, v = torch.randn(2, len(lens), kv_heads, head_dim, generator=gen).to(DEVICE)
    meta = AttentionMetadata.build(tables, lens, [1] * len(lens), block_size, device=DEVICE)
    assert meta.num_decodes == len(lens) and not meta.prefills

    model_out = paged_attention(q, k, v, kv_cache, meta, SCALE)
    # The tables padded to the longest serve as the block table: the padding columns are never read.
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    reference = kernels.paged_decode_attention_reference(q, kv_cache, padded, context_lens, SCALE)
    torch.testing.assert_close(reference, model_out, atol=1e-5, rtol=1e-5)
    kernel = kernels.paged_decode_attention(q, kv_cache, padded, context_lens, SCALE, num_splits=2)
    torch.testing.assert_close(kernel, model_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "split-k"])
@pytest.mark.parametrize("window", [1, 5, 13, 1000], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_windowed_kernel_with_sinks_matches_reference(window, with_sinks, num_splits):
    """A sliding window over tables that start at block 0 (the walk skips the blocks behind the window, whole
    splits included) and per-head sinks in the denominator, against the reference."""
    q, kv_cache, tables, lens = _batch(2, 8, 16, _ragged_lens(8))
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3)).to(DEVICE) if with_sinks else None
    args = (q, kv_cache, tables, lens, SCALE)
    got = kernels.paged_decode_attention(*args, num_splits=num_splits, window=window, sinks=sinks)
    want = kernels.paged_decode_attention_reference(*args, window=window, sinks=sinks)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window < 5 * 8 or with_sinks:  # the window or the sinks change the result: the test can fail
        plain = kernels.paged_decode_attention_reference(*args)
        assert not torch.allclose(plain, want, atol=1e-3)


@pytest.mark.parametrize("window", [3, 8, 11])
def test_windowed_views_with_sinks_match_on_both_decode_paths(window):
    """A decode-only batch through the model's windowed view (tables cut to the window's first block) with
    sinks: the torch buckets and the kernel (its metadata) both equal the reference over the full tables."""
    from shared.model.kernels.choice import KernelChoice

    block_size, kv_heads, head_dim, group = 8, 2, 16, 2
    lens = [1, 8, 19, 9, 30]
    tables = [[3, 7, 1, 13], [0, 9], [2, 4, 6, 11], [5, 8], [10, 12, 14, 15]]
    gen = torch.Generator().manual_seed(window)
    kv_cache = torch.randn(2, 16, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    k, v = torch.randn(2, len(lens), kv_heads, head_dim, generator=gen).to(DEVICE)
    sinks = torch.randn(kv_heads * group, generator=gen).to(DEVICE)
    outs = []
    for choice in (KernelChoice.TORCH, KernelChoice.TRITON):
        cache = kv_cache.clone()
        meta = AttentionMetadata.build(
            tables, lens, [1] * len(lens), block_size, device=DEVICE, kernels=choice, windows={window}
        )
        outs.append(paged_attention(q, k, v, cache, meta.for_window(window), SCALE, sinks))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    want = kernels.paged_decode_attention_reference(
        q, cache, padded, torch.tensor(lens, device=DEVICE), SCALE, window=window, sinks=sinks
    )
    for got in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
