"""Paged attention's decode buckets against a straightforward per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from shared.model.paged_attention import (
    BUCKET_SLACK_SLOTS,
    AttentionMetadata,
    gather_blocks,
    group_decodes,
    paged_attention,
)

BLOCK = 16


def _reference(q, k, v, cache, tables, context_lens, query_lens, scale) -> torch.Tensor:
    """Each sequence alone: write its new K/V at its positions, then causal softmax attention over its own
    context read slot by slot from its block table, with KV heads repeated for GQA."""
    cache = cache.clone()
    heads, kv_heads = q.shape[1], k.shape[1]
    out, start = [], 0
    for table, n, count in zip(tables, context_lens, query_lens, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        flat = cache.view(2, -1, kv_heads, q.shape[2])
        flat[0, slots[n - count :]] = k[start : start + count]
        flat[1, slots[n - count :]] = v[start : start + count]
        keys = flat[0, slots].repeat_interleave(heads // kv_heads, dim=1)  # (n, H, hd)
        values = flat[1, slots].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + count].double(), keys.double()) * scale
        visible = torch.arange(n)[None, :] <= torch.arange(n - count, n)[:, None]  # (count, n)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values.double()).float())
        start += count
    return torch.cat(out)


def _run(context_lens, query_lens, heads=8, kv_heads=2, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in context_lens]
    num_blocks = sum(need) + 3
    # Scattered blocks, and block 0 (the padding block) owned by nobody and full of large values:
    # attending to padding would show.
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at : at + nb] + [perm[-1]])  # one spare block past the context, never read
        at += nb
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    cache[:, 0] = 1e4
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k, v = torch.randn(2, t, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    meta = AttentionMetadata.build(tables, context_lens, query_lens, BLOCK)
    ours = paged_attention(q, k, v, cache.clone(), meta, scale)
    ref = _reference(q, k, v, cache, tables, context_lens, query_lens, scale)
    return meta, ours, ref


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_one_long_many_short_matches_reference(heads, kv_heads):
    lens = [40, 4096, 33, 17, 40, 1, 130]
    meta, ours, ref = _run(lens, [1] * len(lens), heads, kv_heads)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # The long sequence is alone: no short one is padded to its 256 blocks.
    widths = sorted(int(d.blocks.shape[1]) for d in meta.decodes)
    assert widths[-1] == 4096 // BLOCK and widths[-2] < 16


def test_every_length_at_block_boundaries_matches_reference():
    lens = [n for b in range(1, 6) for n in (b * BLOCK - 1, b * BLOCK, b * BLOCK + 1)] + [1, 2]
    lens = lens[::2] + lens[1::2][::-1]  # no sorted order to lean on
    meta, ours, ref = _run(lens, [1] * len(lens))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert len(meta.decodes) > 1


def test_decodes_then_prefill_chunks_match_reference():
    # Decodes of ragged lengths, then a first chunk and a later chunk of two prompts.
    context_lens = [300, 5, 70, 64, 48, 90]
    query_lens = [1, 1, 1, 1, 48, 26]
    _, ours, ref = _run(context_lens, query_lens)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_buckets_cover_every_decode_once_and_pad_only_to_their_longest():
    lens = [130, 17, 4096, 129, 16, 2000, 145]
    meta = AttentionMetadata.build([list(range(300))] * len(lens), lens, [1] * len(lens), BLOCK)
    rows = sorted(i for d in meta.decodes for i in torch.arange(len(lens))[d.rows].tolist())
    assert rows == list(range(len(lens)))
    for d in meta.decodes:
        members = torch.arange(len(lens))[d.rows].tolist()
        assert d.blocks.shape == (len(members), max(-(-lens[i] // BLOCK) for i in members))
        assert d.mask.view(len(members), -1).sum(1).tolist() == [lens[i] for i in members]


def test_uniform_batch_is_one_bucket_in_order():
    meta = AttentionMetadata.build([[3, 4, 5, 6, 7, 8, 9, 10, 11]] * 32, [136] * 32, [1] * 32, BLOCK)
    assert len(meta.decodes) == 1 and meta.decodes[0].rows == slice(0, 32)


def test_bucket_bias_is_the_mask_as_zero_or_minus_inf_made_once_per_dtype():
    meta = AttentionMetadata.build([list(range(20))] * 2, [40, 17], [1, 1], BLOCK)
    (d,) = meta.decodes
    bias = d.bias(torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == d.mask.shape
    assert torch.equal(bias == 0, d.mask) and bool((bias[~d.mask] == float("-inf")).all())
    assert d.bias(torch.bfloat16) is bias  # reused by every layer of the step
    assert d.bias(torch.float32).dtype == torch.float32


def test_gather_blocks_is_advanced_indexing_over_whole_blocks():
    cache = torch.randn(2, 9, BLOCK, 2, 4)
    blocks = torch.tensor([7, 0, 3, 3])
    assert torch.equal(gather_blocks(cache, blocks).view(2, 4, BLOCK, 2, 4), cache[:, blocks])


def test_group_decodes_joins_within_slack_only():
    slack = BUCKET_SLACK_SLOTS // BLOCK
    # Longest first: 1000 alone; 20 heads a bucket that 20 - slack joins and 20 - slack - 1 does not; the
    # latter heads the last bucket.
    assert group_decodes([20 - slack - 1, 20, 1000, 20 - slack, 20 - 2 * slack - 1], slack) == [[2], [1, 3], [0, 4]]
    assert group_decodes([9] * 4, 0) == [[0, 1, 2, 3]]
    assert group_decodes([], slack) == []
