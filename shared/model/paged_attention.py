"""Attention over a paged KV cache, in plain torch (the CPU reference path).

One layer's cache is a tensor (2, N, B, KVH, hd): K|V, blocks, tokens per block, KV heads, head dim.
Viewed flat it is (2, N*B, KVH, hd) with slot = block_id * B + offset. A batch is flat over tokens: the
first `num_decodes` sequences contribute one query token each (tokens 0..num_decodes-1), the rest are
prefill chunks of any length that may continue an earlier chunk already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.device import to_device


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    count: int  # query tokens
    blocks: torch.Tensor  # (nb,) int64: the blocks holding the context
    context_len: int  # cached tokens + this chunk
    mask: torch.Tensor | None  # (count, context_len) bool for a later chunk; None = plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once per step on the host, each tensor
    copied to the device once (`to_device`), shared by all layers."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot each input token's K/V is written to
    num_decodes: int
    # Decode sequences, batched: (Bd, NBmax) block ids padded with block 0; (Bd, 1, 1, NBmax*B) True = attend.
    decode_blocks: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """One entry per sequence, decodes first. context_lens include this step's tokens."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = []
        for bt, n in zip(block_tables, context_lens, strict=True):
            nb = -(-n // block_size)
            if nb > len(bt):
                raise ValueError(f"block table holds {len(bt) * block_size} slots, context needs {n}")
            tables.append(bt[:nb])
        slot_mapping = to_device(
            torch.cat(
                [_slots(bt, n - q, n, block_size) for bt, n, q in zip(tables, context_lens, query_lens, strict=True)]
            ),
            device,
        )

        decode_blocks = decode_mask = None
        if num_decodes:
            nb_max = max(len(t) for t in tables[:num_decodes])
            padded = [t + [0] * (nb_max - len(t)) for t in tables[:num_decodes]]
            decode_blocks = to_device(torch.tensor(padded, dtype=torch.int64), device)
            lens = torch.tensor(context_lens[:num_decodes])
            decode_mask = torch.arange(nb_max * block_size)[None, :] < lens[:, None]
            decode_mask = to_device(decode_mask.view(num_decodes, 1, 1, -1), device)

        prefills = []
        start = num_decodes
        for b in range(num_decodes, len(query_lens)):
            q, n = query_lens[b], context_lens[b]
            mask = None
            if q != n:  # a later chunk: query i sits at position n - q + i and sees keys 0..that position
                mask = to_device(torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None], device)
            blocks = to_device(torch.tensor(tables[b], dtype=torch.int64), device)
            prefills.append(PrefillChunk(start, q, blocks, n, mask))
            start += q
        return cls(slot_mapping, num_decodes, decode_blocks, decode_mask, prefills)


def _slots(block_table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Cache slots of token positions [start, stop)."""
    pos = torch.arange(start, stop)
    return torch.tensor(block_table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (T, H, hd); k, v: (T, KVH, hd) for this step's tokens; kv_cache: (2, N, B, KVH, hd).
    Writes k, v into the cache, then attends over each sequence's whole context. Returns (T, H, hd)."""
    kvh, hd = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, kvh, hd)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        # Whole blocks in one gather: (2, Bd, NB, B, KVH, hd) → (2, Bd, KVH, NB*B, hd)
        ctx = kv_cache[:, meta.decode_blocks].flatten(2, 3).transpose(2, 3)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), ctx[0], ctx[1], attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for c in meta.prefills:
        # 4-D (1, heads, tokens, hd): with a batch dimension torch picks its fused CPU kernel
        # instead of the math fallback that materializes the whole causal mask.
        ctx = kv_cache[:, c.blocks].flatten(1, 2)[:, : c.context_len].transpose(1, 2)  # (2, KVH, L, hd)
        qs = q[c.start : c.start + c.count].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ctx[0:1], ctx[1:2], attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=True
        )
        out[c.start : c.start + c.count] = o[0].transpose(0, 1)
    return out
