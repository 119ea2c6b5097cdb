"""Attention over a paged KV cache, in plain torch (the CPU reference path).

Layout of one layer's cache: k_cache, v_cache are (num_blocks, block_size, KVH, hd); viewed flat they are
(num_slots, KVH, hd) with slot = block_id * block_size + offset. A batch is flat over tokens: the first
`num_decodes` sequences contribute one query token each (tokens 0..num_decodes-1), the rest are prefill
chunks of any length that may continue an earlier chunk already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot each input token's K/V is written to
    num_decodes: int
    # Decode sequences, batched: (Bd, Lmax) slots of each context, padded; (Bd, 1, 1, Lmax) True = attend.
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    # Prefill chunks, one entry each: (token start, token count, context slots (L,), causal mask or None).
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]

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
        slots = [_context_slots(bt, n, block_size) for bt, n in zip(block_tables, context_lens, strict=True)]
        slot_mapping = torch.cat([s[n - q :] for s, n, q in zip(slots, context_lens, query_lens, strict=True)]).to(
            device
        )

        decode_slots = decode_mask = None
        if num_decodes:
            lmax = max(context_lens[:num_decodes])
            decode_slots = torch.zeros(num_decodes, lmax, dtype=torch.int64)
            for b in range(num_decodes):
                decode_slots[b, : context_lens[b]] = slots[b]
            lens = torch.tensor(context_lens[:num_decodes])
            decode_mask = (torch.arange(lmax)[None, :] < lens[:, None]).view(num_decodes, 1, 1, lmax)
            decode_slots, decode_mask = decode_slots.to(device), decode_mask.to(device)

        prefills = []
        start = num_decodes
        for b in range(num_decodes, len(query_lens)):
            q, n = query_lens[b], context_lens[b]
            mask = None
            if q != n:  # a later chunk: query i sits at position n - q + i and sees keys 0..that position
                mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
                mask = mask.to(device)
            prefills.append((start, q, slots[b].to(device), mask))
            start += q
        return cls(slot_mapping, num_decodes, decode_slots, decode_mask, prefills)


def _context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table, dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
    if slots.numel() < length:
        raise ValueError(f"block table holds {slots.numel()} slots, context needs {length}")
    return slots[:length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (T, H, hd); k, v: (T, KVH, hd) for this step's tokens. Writes k, v into the cache, then attends
    over each sequence's whole context. Returns (T, H, hd)."""
    kvh, hd = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, kvh, hd)
    flat_v = v_cache.view(-1, kvh, hd)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        keys = flat_k[meta.decode_slots].transpose(1, 2)  # (Bd, KVH, L, hd)
        values = flat_v[meta.decode_slots].transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for start, count, slots, mask in meta.prefills:
        qs = q[start : start + count].transpose(0, 1)  # (H, n, hd)
        keys = flat_k[slots].transpose(0, 1)  # (KVH, L, hd)
        values = flat_v[slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[start : start + count] = o.transpose(0, 1)
    return out
