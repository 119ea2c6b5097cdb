"""The CPU paged decode attention kernel (shared/model/kernels/cpu_attention.c) against the torch bucket path of
shared/model/paged_attention.py (gather + SDPA), and its wiring into paged_attention and the engine."""

from __future__ import annotations

import pytest
import torch

from shared.model.kernels import cpu_attention
from shared.model.kernels.choice import KernelChoice
from shared.model.paged_attention import AttentionMetadata, paged_attention

LIB = cpu_attention.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU attention kernel cannot be built or run on this host")


def _batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, block: int, seed: int = 0):
    """Scattered blocks per sequence (one spare past each context, never read) and block 0, the padding block,
    owned by nobody and full of large values: attending to padding or to a spare block would show.
    → (tables, cache (2, N, B, KVH, hd), q (Bd, H, hd), k, v (Bd, KVH, hd): this step's K/V, already cached)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at : at + nb] + [perm[-1]])
        at += nb
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=gen)
    cache[:, 0] = 1e4
    cache[:, perm[-1]] = 1e4
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    flat = cache.view(2, -1, kv_heads, head_dim)
    last = torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens, strict=True)])
    return tables, cache, q, flat[0, last].clone(), flat[1, last].clone()


def _both(lens, heads, kv_heads, head_dim, block, window=None, seed=0):
    """→ (kernel, torch bucket path) outputs of paged_attention for one decode step."""
    tables, cache, q, k, v = _batch(lens, heads, kv_heads, head_dim, block, seed)
    windows = {window} if window else set()
    outs = []
    for kernel in (True, False):
        meta = AttentionMetadata.build(tables, lens, [1] * len(lens), block, windows=windows, cpu_decode_kernel=kernel)
        view = meta.for_window(window)
        assert (view.kernel_decodes is not None) == kernel and (view.decodes == []) == kernel
        outs.append(paged_attention(q, k, v, cache, view, head_dim**-0.5))
    return outs


# 32 sequences: lengths 1, 2, block boundaries and a long one, so buckets and tiles of every fill occur
RAGGED = [1, 2, 15, 16, 17, 33, 64, 100] * 3 + [600, 129, 5, 47, 80, 31, 3, 1]


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_kernel_matches_torch_path_for_gqa_ratios_and_block_sizes(group, block):
    kernel, torch_path = _both(RAGGED, heads=2 * group, kv_heads=2, head_dim=64, block=block)
    torch.testing.assert_close(kernel, torch_path, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: not a multiple of 16, so AVX2 even on AVX-512
@pytest.mark.parametrize("window", [None, 1, 7, 50])
def test_kernel_matches_torch_path_for_head_dims_and_windows(head_dim, window):
    kernel, torch_path = _both(RAGGED, heads=8, kv_heads=2, head_dim=head_dim, block=4, window=window, seed=1)
    torch.testing.assert_close(kernel, torch_path, rtol=0, atol=1e-5)


@needs_kernel
def test_long_sequence_among_short_ones():
    kernel, torch_path = _both([128] * 31 + [600], heads=8, kv_heads=2, head_dim=64, block=16, seed=2)
    torch.testing.assert_close(kernel, torch_path, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 40])
def test_one_two_and_three_threads_give_the_same_bits(head_dim):
    """Each (sequence, KV head) pair is one thread's, computed in a fixed order: the thread count may not show."""
    lens = RAGGED
    tables, cache, q, _, _ = _batch(lens, 8, 2, head_dim, 4, seed=3)
    meta = AttentionMetadata.build(tables, lens, [1] * len(lens), 4, windows={7}, cpu_decode_kernel=True)
    assert LIB is not None
    for window in (None, 7):
        kd = meta.for_window(window).kernel_decodes
        assert kd is not None and kd.cpu_kernel
        one, two, three = (
            cpu_attention.paged_decode(LIB, q, cache, kd.blocks, kd.context_lens, 0.125, kd.window, threads=n)
            for n in (1, 2, 3)
        )
        assert torch.equal(one, two) and torch.equal(one, three)


@needs_kernel
def test_decodes_take_the_kernel_and_prefill_chunks_the_torch_path():
    """A mixed batch: decode tokens through the kernel, a prefill chunk after them as before."""
    lens, query_lens, block = [40, 9, 30], [1, 1, 12], 4
    tables, cache, _, _, _ = _batch(lens, 8, 2, 64, block, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(query_lens), 8, 64, generator=gen)
    k, v = torch.randn(2, sum(query_lens), 2, 64, generator=gen)
    outs = [
        paged_attention(
            q, k, v, cache.clone(), AttentionMetadata.build(tables, lens, query_lens, block, cpu_decode_kernel=c), 0.125
        )
        for c in (True, False)
    ]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
    assert torch.equal(outs[0][2:], outs[1][2:])  # the prefill chunk: the same torch path, the same bits


def test_kernel_refuses_what_it_cannot_compute():
    assert "float32" in (cpu_attention.supports(64, torch.bfloat16, False) or "")
    assert "sinks" in (cpu_attention.supports(64, torch.float32, True) or "")
    assert "multiple" in (cpu_attention.supports(36, torch.float32, False) or "")
    assert cpu_attention.supports(64, torch.float32, False) is None
    with pytest.raises(ValueError, match="triton"):
        AttentionMetadata.build([[1]], [1], [1], 16, kernels=KernelChoice.TRITON, cpu_decode_kernel=True)


@needs_kernel
def test_model_choice_follows_dtype_and_sinks():
    from shared.model.attention import use_cpu_attention_kernel
    from shared.model.config import ModelConfig
    from shared.model.transformer import CausalLM

    cfg = ModelConfig.from_dict({
        "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })  # fmt: skip
    model = CausalLM(cfg)
    assert "cpu kernel in 2 layers" in use_cpu_attention_kernel(model) and model.cpu_attention
    assert "float32" in use_cpu_attention_kernel(model.to(torch.bfloat16)) and not model.cpu_attention


@needs_kernel
def test_a_decode_only_step_writes_its_kv_in_the_kernel_as_the_torch_path_does():
    """A decode-only step on the kernel writes the step's K/V into the cache inside the call: the cache ends
    bytewise as the torch path's index_copy_ leaves it, and the attention sees the new rows. K and V are views
    of one fused projection's row (strided), as the attention layer hands them over."""
    lens, block, kv_heads, head_dim = [1, 16, 17, 40], 4, 2, 64
    tables, cache, q, _, _ = _batch(lens, 8, kv_heads, head_dim, block, seed=6)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(len(lens), (8 + 2 * kv_heads) * head_dim, generator=gen) * 3  # unlike any cached row
    k = qkv[:, 8 * head_dim : (8 + kv_heads) * head_dim].view(len(lens), kv_heads, head_dim)
    v = qkv[:, (8 + kv_heads) * head_dim :].view(len(lens), kv_heads, head_dim)
    caches, outs = [], []
    for kernel in (True, False):
        meta = AttentionMetadata.build(tables, lens, [1] * len(lens), block, cpu_decode_kernel=kernel)
        caches.append(cache.clone())
        outs.append(paged_attention(q, k, v, caches[-1], meta, head_dim**-0.5))
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], cache)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    lens, block = [5, 9], 4
    tables, cache, q, k, v = _batch(lens, 8, 2, 64, block, seed=8)
    kd = AttentionMetadata.build(tables, lens, [1, 1], block, cpu_decode_kernel=True).kernel_decodes
    assert kd is not None and LIB is not None
    before = cache.clone()
    slots = torch.tensor([3, cache.shape[1] * block], dtype=torch.int64)  # the second one past the end
    with pytest.raises(IndexError):
        cpu_attention.paged_decode(LIB, q, cache, kd.blocks, kd.context_lens, 0.125, write=(k + 1, v + 1, slots))
    assert torch.equal(cache, before)
