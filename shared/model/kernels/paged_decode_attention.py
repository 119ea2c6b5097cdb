"""Decode-phase attention over the paged KV pool, in Triton, and the plain-torch reference it is held to.

Decode: one query token per sequence. Shapes (legend used below):
  Bd sequences, H query heads, KVH KV heads (GQA group G = H // KVH), hd head dim,
  N pool blocks, B tokens per block, NBmax block-table width, S context splits.
  q (Bd, H, hd); kv_cache (2, N, B, KVH, hd) = K|V of one layer (as in shared/model/paged_attention.py);
  block_tables (Bd, NBmax) int32/int64; context_lens (Bd,) int, each >= 1 and <= NBmax * B.

The kernel reads K/V in place through the block table (no gather copy) and each sequence walks only its
own cdiv(context_len, B) blocks: ragged batches cost no padding. One program handles one (sequence, KV
head, split) and all G query heads that share that KV head, so each K/V block is loaded once per group
instead of once per query head (decode is bound by reading the cache). Softmax is online, in fp32, in the
log2 domain (exp2). Long contexts are split (split-K / flash-decoding): the first kernel writes a partial
(max, sum, acc) per split, the second merges them; with one split the first kernel writes the output.

Sliding windows: with `window` W, keys more than W - 1 positions behind the query (position context_len - 1)
are masked; the caller passes block tables that start at the window's first block (paged_attention.py), so
the walk covers at most cdiv(W, B) + 1 blocks (a table that starts earlier works too: the walk skips the
blocks behind the window). Attention sinks (gpt-oss): a per-head logit whose exp joins
the softmax denominator only (`sinks`, (H,) float), added where the output is normalized.

Scores and P·V are broadcast-multiply-and-sum, not tl.dot: G is often < 16, below tl.dot's minimum tile,
and a decode step does O(1) work per loaded element anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves
MAX_SPLITS = 16
TARGET_PROGRAMS = 256  # about two waves of programs on a 132-SM GPU; more splits buy no parallelism


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e)
    blocks_per_split, num_splits,
    window,  # keys at positions < context_len - window are masked (window >= context_len: none)
    stride_qb, stride_qh, stride_qd,
    stride_ckv, stride_cn, stride_ct, stride_ch, stride_cd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    lowest = context_len - window  # the first key position in the window
    # a split (or the blocks of one) wholly behind the window is skipped: m stays -inf, l 0, the merge weighs it 0
    last = tl.minimum((split + 1) * blocks_per_split, tl.cdiv(context_len, BLOCK_SIZE))
    first = tl.maximum(split * blocks_per_split, tl.maximum(lowest, 0) // BLOCK_SIZE)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + offs_g  # (G,) the query heads sharing this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * qk_scale  # (G, hd)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # running sum of p * V
    kv_offs = offs_t[:, None] * stride_ct + offs_d[None, :] * stride_cd  # (B, hd) within one block
    for i in range(first, last):
        block = tl.load(tables_ptr + seq * stride_tb + i * stride_tn).to(tl.int64)  # int64: pools exceed 2**31
        pos = i * BLOCK_SIZE + offs_t
        # the last block of a sequence is partial; with a window, so is the first
        t_mask = (pos < context_len) & (pos >= lowest)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        base = cache_ptr + block * stride_cn + kv_head * stride_ch
        k = tl.load(base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (B, hd)
        v = tl.load(base + stride_ckv + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, B)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # Every visited block holds >= 1 valid token (the walk starts at the window's first block), so m_new
        # is finite and exp2 never sees inf - inf.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    gd_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partials are contiguous: m, l (Bd, H, S); acc (Bd, H, S, hd). A split past this sequence's
        # end stores (-inf, 0, 0); the merge never reads it.
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # (G,)
        tl.store(part_m_ptr + row, m, mask=g_mask)
        tl.store(part_l_ptr + row, l_sum, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gd_mask)
    else:
        if HAS_SINKS:  # the sink's exp joins the denominator (log2 units, relative to the running max)
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_sum = l_sum + tl.exp2(sink - m)
        out = acc / l_sum[:, None]
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _merge_splits_kernel(
    lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr,
    blocks_per_split, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head): merges the splits that sequence used."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.cdiv(tl.load(lens_ptr + seq), BLOCK_SIZE), blocks_per_split)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < used
    row = (seq * tl.num_programs(1) + head) * num_splits + offs_s  # (S,)
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # (S, hd)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - m_max)  # (S,) unused splits: exp2(-inf) = 0
    denominator = tl.sum(l_sum * weight, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max)
    out = tl.sum(acc * weight[:, None], axis=0) / denominator
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv, typed as returning a constexpr


def choose_num_splits(batch: int, kv_heads: int, max_blocks: int, block_size: int, max_context_len: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, none shorter than MIN_SPLIT_TOKENS."""
    by_length = _cdiv(max_context_len, MIN_SPLIT_TOKENS)
    by_occupancy = max(1, TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS, max_blocks))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (the last `window` keys of it when
    given; sinks: (H,) logits joining the denominator). Returns a new (Bd, H, hd) tensor in q's dtype; reads
    kv_cache, writes nothing else. Shapes: see the module docstring.

    num_splits forces the split-K count (clamped to the block-table width); by default it is chosen from
    max_context_len, the longest context in the batch as a host int (the runner knows it), else from the
    block-table width (an upper bound that costs no device sync)."""
    bd, h, hd, kvh, block_size = _check_shapes(q, kv_cache, block_tables, context_lens)
    max_blocks = block_tables.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bd == 0:
        return out
    if num_splits is None:
        longest = max_context_len if max_context_len is not None else max_blocks * block_size
        if window is not None:
            longest = min(longest, window + block_size)
        num_splits = choose_num_splits(bd, kvh, max_blocks, block_size, longest)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    blocks_per_split = _cdiv(max_blocks, min(num_splits, max_blocks))
    num_splits = _cdiv(max_blocks, blocks_per_split)  # no trailing split that every sequence skips
    split = num_splits > 1
    if split:
        part_m = torch.empty((bd, h, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((bd, h, num_splits, hd), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # never touched: SPLIT is a constexpr
    group = h // kvh
    has_sinks = sinks is not None
    sinks_arg = sinks if sinks is not None else out  # never read without HAS_SINKS
    window_arg = window if window is not None else max(max_context_len or 0, max_blocks * block_size)
    # the ignores below: triton types a kernel's constexpr parameters as tl.constexpr; launches pass plain values
    _decode_kernel[(bd, kvh, num_splits)](
        q, kv_cache, block_tables, context_lens, out, part_m, part_l, part_acc, sinks_arg,
        scale * LOG2E,
        blocks_per_split, num_splits,
        window_arg,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),  # pyright: ignore[reportArgumentType]
        HEAD_DIM=hd, HEAD_DIM_PAD=triton.next_power_of_2(hd),  # pyright: ignore[reportArgumentType]
        BLOCK_SIZE=block_size, SPLIT=split, HAS_SINKS=has_sinks,  # pyright: ignore[reportArgumentType]
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(bd, h)](
            context_lens, out, part_m, part_l, part_acc, sinks_arg,
            blocks_per_split, num_splits,
            *out.stride(),
            HEAD_DIM=hd, HEAD_DIM_PAD=triton.next_power_of_2(hd),  # pyright: ignore[reportArgumentType]
            BLOCK_SIZE=block_size, SPLITS_PAD=triton.next_power_of_2(num_splits),  # pyright: ignore[reportArgumentType]
            HAS_SINKS=has_sinks,  # pyright: ignore[reportArgumentType]
        )  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference the kernel is tested against: gathers each sequence's context and runs a plain fp32
    softmax (the sink, when given, as one more logit whose column is dropped). Same signature and result as
    paged_decode_attention; the tuning arguments are ignored."""
    del num_splits, max_context_len
    _, h, _, kvh, block_size = _check_shapes(q, kv_cache, block_tables, context_lens)
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = kv_cache[:, blocks].flatten(1, 2)[:, :n].float().repeat_interleave(h // kvh, dim=2)  # (n, H, hd)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if window is not None:
            scores[:, : max(0, n - window)] = float("-inf")
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
        probs = scores.softmax(dim=-1)[:, :n]
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out


def _check_shapes(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Validates shapes on the host (no device sync); returns (Bd, H, hd, KVH, B)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"want q (Bd, H, hd) and kv_cache (2, N, B, KVH, hd), got {q.shape}, {kv_cache.shape}")
    bd, h, hd = q.shape
    _, _, block_size, kvh, cache_hd = kv_cache.shape
    if cache_hd != hd or h % kvh:
        raise ValueError(f"q heads {h} x {hd} do not fit kv heads {kvh} x {cache_hd}")
    if block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != bd or context_lens.shape != (bd,):
        raise ValueError(f"want block_tables (Bd, NBmax), context_lens (Bd,) for Bd={bd}")
    if bd and block_tables.shape[1] == 0:
        raise ValueError("block_tables has no columns: every context holds at least one token")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    return bd, h, hd, kvh, block_size
