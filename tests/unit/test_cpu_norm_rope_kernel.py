"""The CPU RMSNorm and q/k norm + RoPE kernel (shared/model/kernels/cpu_norm_rope.c) against the torch ops it
replaces (RMSNorm's F.rms_norm, apply_rotary), and its wiring into the model and the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.attention import Attention, use_cpu_norm_rope_kernel
from shared.model.kernels import cpu_norm_rope
from shared.model.layers import RMSNorm, RopeTables, apply_rotary

LIB = cpu_norm_rope.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU norm kernel cannot be built on this host")


def _tables(positions: torch.Tensor, dim: int) -> RopeTables:
    """RopeTables as Rotary.tables builds them, (T, 1, dim), for positions far apart (large angles)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(positions.float(), inv_freq).repeat(1, 2)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    return RopeTables(cos, sin, torch.cat((-sin[..., : dim // 2], sin[..., dim // 2 :]), -1))


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q, k as the attention layer has them: (T, H, hd) and (T, KVH, hd) views of one fused projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)


@needs_kernel
@pytest.mark.parametrize("rows, dim", [(1, 64), (3, 100), (32, 512), (5, 7168), (600, 48)])
def test_rms_norm_matches_torch(rows, dim):
    gen = torch.Generator().manual_seed(dim)
    x, w = torch.randn(rows, dim, generator=gen) * 4, torch.randn(dim, generator=gen)
    out = cpu_norm_rope.rms_norm(LIB, x, w, 1e-6)
    assert out is not None and out.is_contiguous()
    torch.testing.assert_close(out, F.rms_norm(x, [dim], w, 1e-6), rtol=1e-6, atol=1e-5)


@needs_kernel
def test_rms_norm_reads_strided_rows_and_refuses_other_layouts():
    gen = torch.Generator().manual_seed(1)
    base, w = torch.randn(4, 6, 96, generator=gen), torch.randn(64, generator=gen)
    columns = base[..., 16:80]  # every row one stride after the previous: read in place
    out = cpu_norm_rope.rms_norm(LIB, columns, w, 1e-5)
    assert out is not None and out.shape == columns.shape
    torch.testing.assert_close(out, F.rms_norm(columns, [64], w, 1e-5), rtol=1e-6, atol=1e-5)
    assert cpu_norm_rope.rms_norm(LIB, base[:, :3, 16:80], w, 1e-5) is None  # rows not evenly spaced
    assert cpu_norm_rope.rms_norm(LIB, base[..., :64].transpose(0, 1), w, 1e-5) is None
    assert cpu_norm_rope.rms_norm(LIB, base[..., :64].to(torch.bfloat16), w, 1e-5) is None


@needs_kernel
@pytest.mark.parametrize("rows, dim", [(1, 64), (32, 512), (9, 200)])
def test_add_then_norm_in_one_pass(rows, dim):
    """The residual stream is bitwise x + delta (the add rounds once either way); its norm as F.rms_norm's."""
    gen = torch.Generator().manual_seed(rows)
    x, delta, w = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen), torch.randn(dim)
    fused = cpu_norm_rope.add_rms_norm(LIB, x, delta, w, 1e-6)
    assert fused is not None
    assert torch.equal(fused[0], x + delta)
    torch.testing.assert_close(fused[1], F.rms_norm(x + delta, [dim], w, 1e-6), rtol=1e-6, atol=1e-5)
    assert cpu_norm_rope.add_rms_norm(LIB, x, torch.randn(rows, 2 * dim)[:, ::2], w, 1e-6) is None  # strided
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch_h, torch_normed = norm(x, delta)  # no kernel set: the torch ops
    assert torch.equal(torch_h, x + delta) and torch.equal(torch_normed, norm(x + delta))


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(8, 2, 64, 64), (4, 4, 128, 128), (6, 2, 64, 32)])
def test_rope_alone_is_bitwise_apply_rotary(heads, kv_heads, head_dim, rotary_dim):
    """The rotation does what apply_rotary does, in its order of roundings: the same bits (partial rotary: the
    dims past the tables pass through)."""
    q, k = _qkv(33, heads, kv_heads, head_dim)
    tables = _tables(torch.arange(33) * 97, rotary_dim)
    got = cpu_norm_rope.qk_norm_rope(LIB, q, k, tables.cos, tables.signed_sin)
    want = apply_rotary(q, k, tables)
    assert all(g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want, strict=True))


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: a tail past the 16-lane sums
def test_per_head_norm_then_rope_matches_the_torch_ops(head_dim):
    q, k = _qkv(17, 8, 2, head_dim, seed=2)
    tables = _tables(torch.arange(17) * 31, head_dim)
    gen = torch.Generator().manual_seed(3)
    wq, wk = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)
    got = cpu_norm_rope.qk_norm_rope(LIB, q, k, tables.cos, tables.signed_sin, wq, wk, 1e-6)
    want = apply_rotary(F.rms_norm(q, [head_dim], wq, 1e-6), F.rms_norm(k, [head_dim], wk, 1e-6), tables)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5)


@needs_kernel
def test_thread_count_does_not_change_the_bits():
    """Prefill-sized inputs split rows over threads; each row is one thread's, so the bits stay."""
    q, k = _qkv(2048, 8, 2, 64, seed=4)
    tables = _tables(torch.arange(2048), 64)
    w = torch.randn(64)
    x = torch.randn(2048, 512)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            normed = cpu_norm_rope.rms_norm(LIB, x, torch.ones(512), 1e-6)
            results.append((normed, *cpu_norm_rope.qk_norm_rope(LIB, q, k, tables.cos, tables.signed_sin, w, w, 1e-6)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))


@needs_kernel
def test_an_empty_batch_gives_empty_results():
    q, k = _qkv(0, 4, 2, 32)
    tables = _tables(torch.arange(0), 32)
    got = cpu_norm_rope.qk_norm_rope(LIB, q, k, tables.cos, tables.signed_sin, torch.ones(32), torch.ones(32), 1e-6)
    assert [tuple(g.shape) for g in got] == [(0, 4, 32), (0, 2, 32)]
    assert cpu_norm_rope.rms_norm(LIB, torch.empty(0, 64), torch.ones(64), 1e-6).shape == (0, 64)


def test_bad_inputs_are_refused():
    if LIB is None:
        pytest.skip("no kernel")
    q, k = _qkv(4, 4, 2, 32)
    tables = _tables(torch.arange(4), 32)
    with pytest.raises(ValueError, match="together"):
        cpu_norm_rope.qk_norm_rope(LIB, q, k, tables.cos, tables.signed_sin, torch.ones(32), None)
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_norm_rope.qk_norm_rope(LIB, q.transpose(1, 2).contiguous().transpose(1, 2), k, tables.cos, tables.sin)
    with pytest.raises(ValueError, match="width"):
        wide = _tables(torch.arange(4), 64)
        cpu_norm_rope.qk_norm_rope(LIB, q, k, wide.cos, wide.signed_sin)


@needs_kernel
def test_engine_wires_the_kernel_and_greedy_tokens_match_the_torch_ops(model_dir):
    """The tiny Qwen3-MoE (per-head q/k norms): every norm and attention layer takes the kernel, and greedy
    decoding gives the tokens of the torch ops (cpu_norm_kernel=False)."""
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on = Engine.from_dir(model_dir, num_kv_blocks=32, max_model_len=128)
    off = Engine.from_dir(model_dir, num_kv_blocks=32, max_model_len=128, cpu_norm_kernel=False)
    norms = [m for m in on.model.modules() if isinstance(m, RMSNorm)]
    attention = [m for m in on.model.modules() if isinstance(m, Attention)]
    assert norms and attention and all(m.kernel is LIB for m in norms) and all(m.rope_kernel is LIB for m in attention)
    assert all(m.kernel is None for m in off.model.modules() if isinstance(m, RMSNorm))
    assert on.generate(prompts, params) == off.generate(prompts, params)


@needs_kernel
def test_other_dtypes_keep_the_torch_ops(model_dir):
    engine = Engine.from_dir(model_dir, num_kv_blocks=32, max_model_len=128)
    model = engine.model.to(torch.bfloat16)
    assert "float32 only" in use_cpu_norm_rope_kernel(model)
    assert all(m.kernel is None for m in model.modules() if isinstance(m, RMSNorm))
