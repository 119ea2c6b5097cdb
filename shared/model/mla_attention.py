"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Shapes: T tokens of the step, H query heads (this rank's), R = kv_lora_rank, P = qk_rope_head_dim,
N = qk_nope_head_dim, V = v_head_dim, W = R + P (one cache entry). One layer's cache is (1, NB, B, 1, W):
one plane, one "head" (the latent is shared by every head), per token [c_kv (R) | roped k_pe (P)].

The scores of head h against a cached token are q_nope_h . (W_UK_h c) + q_pe_h . k_pe, and its output is
W_UV_h (sum_j p_j c_j), where W_UK_h (N, R) and W_UV_h (V, R) are head h's rows of kv_b_proj. Two forms compute it:
- expanded: up-project every context token's latent to per-head K_nope and V (kv_b_proj), then ordinary attention
  with head dim N + P. Costs ~L * H * R * (N + V) for the up-projection of L context tokens.
- absorbed: fold W_UK into the query (q_abs_h = W_UK_h^T q_nope_h, R wide), attend over the latent itself as one
  shared key [c | k_pe] and value c (multi-query attention with head dim W), apply W_UV to the (H, R) output.
  Costs ~count * L * H * (W + R) for `count` query tokens, and reads nothing but the latent cache.
Decode (count = 1) is always cheaper absorbed; a prefill chunk is absorbed when count * (W + R) < R * (N + V)
(short chunks over long cached contexts), expanded otherwise. `MLAForm` forces one form (benchmarks, tests).

Tensor-parallel (shard.tp > 1): a rank computes its query heads: its rows of q_proj/q_b_proj and kv_b_proj, its
columns of o_proj (row-parallel, all-reduced). The latent projection (q_a_proj, kv_a_proj_with_mqa, their norms)
is replicated, and so is the latent cache: every rank holds the whole latent (it has no heads to split).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import RMSNorm, RopeTables, apply_rotary, apply_rotary_interleaved
from shared.model.linear import PackedWeights, linear
from shared.model.paged_attention import AttentionMetadata, PrefillChunk
from shared.model.tensor_parallel import TensorShard
from shared.sharding.layout import head_range


class MLAForm(Enum):
    AUTO = "auto"  # decode absorbed, each prefill chunk by the cost rule above
    ABSORBED = "absorbed"  # every token absorbed
    EXPANDED = "expanded"  # every token expanded (the non-absorbed baseline)


class MLAAttention(nn.Module, PackedWeights):
    def __init__(self, cfg: ModelConfig, shard: TensorShard = TensorShard.SINGLE) -> None:
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError(f"{cfg.model_type} has no multi-head latent attention config")
        self.shard, self.mla = shard, mla
        heads = head_range(cfg.num_heads, shard.tp, shard.rank)
        self.num_heads = h = len(heads)
        self.heads = heads
        d, r, qk, v = cfg.hidden_size, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim
        self.scale = qk**-0.5 * cfg.rope.softmax_scale_factor
        self.form = MLAForm.AUTO
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Parameter(torch.empty(h * qk, d))
        else:
            self.q_a_proj = nn.Parameter(torch.empty(mla.q_lora_rank, d))
            self.q_a_bias = nn.Parameter(torch.empty(mla.q_lora_rank)) if bias else None
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # transformers builds it with the default eps
            self.q_b_proj = nn.Parameter(torch.empty(h * qk, mla.q_lora_rank))
        self.kv_a_proj_with_mqa = nn.Parameter(torch.empty(mla.latent_width, d))
        self.kv_a_bias = nn.Parameter(torch.empty(mla.latent_width)) if bias else None
        self.kv_a_layernorm = RMSNorm(r, 1e-6)
        self.kv_b_proj = nn.Parameter(torch.empty(h * (mla.qk_nope_head_dim + v), r))
        self.o_proj = nn.Parameter(torch.empty(d, h * v))
        self.o_bias = nn.Parameter(torch.empty(d)) if bias else None
        q_weights = ("q_proj",) if mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        # kv_b_proj stays plain: the absorbed form reads it as per-head (H, N + V, R) views
        self.LINEAR_WEIGHTS = (*q_weights, "kv_a_proj_with_mqa", "o_proj")

    def checkpoint_shards(self) -> dict[str, tuple]:
        mla, src, hs = self.mla, self.shard.source, self.heads
        q_rows = range(hs.start * mla.qk_head_dim, hs.stop * mla.qk_head_dim)
        kv_per_head = mla.qk_nope_head_dim + mla.v_head_dim
        kv_rows = range(hs.start * kv_per_head, hs.stop * kv_per_head)
        o_cols = range(hs.start * mla.v_head_dim, hs.stop * mla.v_head_dim)
        shards = {
            "kv_a_proj_with_mqa.weight": ("kv_a_proj_with_mqa", ()),
            "kv_b_proj.weight": ("kv_b_proj", (), src(kv_rows)),
            "o_proj.weight": ("o_proj", (), src(None, o_cols)),
        }
        if mla.q_lora_rank is None:
            shards["q_proj.weight"] = ("q_proj", (), src(q_rows))
        else:
            shards |= {"q_a_proj.weight": ("q_a_proj", ()), "q_b_proj.weight": ("q_b_proj", (), src(q_rows))}
        if mla.attention_bias:
            shards |= {"kv_a_proj_with_mqa.bias": ("kv_a_bias", ()), "o_proj.bias": ("o_bias", ())}
            if mla.q_lora_rank is not None:
                shards["q_a_proj.bias"] = ("q_a_bias", ())
        return shards

    def forward(
        self,
        x: torch.Tensor,  # (T, D)
        rope: RopeTables,  # Rotary.tables() of this step's positions, (T, 1, P) each
        kv_cache: torch.Tensor,  # (1, NB, B, 1, W)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, t = self.mla, x.shape[0]
        r = mla.kv_lora_rank
        if mla.q_lora_rank is None:
            q = linear(x, self.w("q_proj"))
        else:
            q = linear(self.q_a_layernorm(linear(x, self.w("q_a_proj"), self.q_a_bias)), self.w("q_b_proj"))
        q = q.view(t, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c, k_pe = linear(x, self.w("kv_a_proj_with_mqa"), self.kv_a_bias).split([r, mla.qk_rope_head_dim], -1)
        rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe, k_pe.unsqueeze(1), rope)  # (T, H, P), (T, 1, P)
        latent = torch.cat([self.kv_a_layernorm(c), k_pe[:, 0]], dim=-1)  # (T, W)
        kv_cache.view(-1, mla.latent_width).index_copy_(0, meta.slot_mapping, latent)

        out = x.new_empty(t, self.num_heads, mla.v_head_dim)
        nd = meta.num_decodes
        if nd:
            if self.form is MLAForm.EXPANDED:
                out[:nd] = self._decode_expanded(q_nope[:nd], q_pe[:nd], kv_cache, meta)
            else:
                out[:nd] = self._decode_absorbed(q_nope[:nd], q_pe[:nd], kv_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.count)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], kv_cache, chunk)
        o = self.shard.all_reduce_(linear(out.reshape(t, -1), self.w("o_proj")))
        return o if self.o_bias is None else o + self.o_bias

    # -- the two forms ---------------------------------------------------------------------------------------

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as per-head W_UK (H, N, R) and W_UV (H, V, R): views, no copy."""
        mla = self.mla
        w = self.kv_b_proj.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def _absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """(n, H, N), (n, H, P) → the latent-space query (n, H, W): [W_UK_h^T q_nope_h | q_pe_h]."""
        w_uk, _ = self._up_weights()
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (H, n, N) @ (H, N, R) → (n, H, R)
        return torch.cat([q_abs, q_pe], dim=-1)

    def _unabsorb_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """(n, H, R) latent-space attention output → (n, H, V): W_UV_h applied per head."""
        _, w_uv = self._up_weights()
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context latent (..., L, W) → per-head K (..., H, L, N + P) and V (..., H, L, V)."""
        mla = self.mla
        c, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        kv = linear(c, self.kv_b_proj).unflatten(-1, (self.num_heads, -1)).transpose(-3, -2)  # (..., H, L, N + V)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe.unsqueeze(-3).expand(*k_nope.shape[:-1], -1)], dim=-1)
        return k, v

    def _decode_absorbed(self, q_nope, q_pe, kv_cache, meta) -> torch.Tensor:
        """Decode tokens 0..nd-1 (one query each) over the latent cache: (nd, H, V)."""
        query = self._absorb_query(q_nope, q_pe)  # (nd, H, W)
        o_latent = query.new_empty(*query.shape[:2], self.mla.kv_lora_rank)
        for rows, blocks, mask in _decode_groups(meta, kv_cache.shape[2]):
            ctx = kv_cache[0][blocks].flatten(1, 3).unsqueeze(1)  # (b, 1, L, W): one key "head" for all H
            # the H heads as H query rows of that one key head: one (H x L) product per sequence
            o = F.scaled_dot_product_attention(
                query[rows].unsqueeze(1), ctx, ctx[..., : self.mla.kv_lora_rank], attn_mask=mask, scale=self.scale
            )
            o_latent[rows] = o[:, 0]
        return self._unabsorb_output(o_latent)

    def _decode_expanded(self, q_nope, q_pe, kv_cache, meta) -> torch.Tensor:
        """The same decode attention with every context token up-projected to per-head K and V."""
        query = torch.cat([q_nope, q_pe], dim=-1)  # (nd, H, N + P)
        out = query.new_empty(*query.shape[:2], self.mla.v_head_dim)
        for rows, blocks, mask in _decode_groups(meta, kv_cache.shape[2]):
            k, v = self._expand(kv_cache[0][blocks].flatten(1, 3))  # (b, H, L, N + P), (b, H, L, V)
            o = F.scaled_dot_product_attention(query[rows].unsqueeze(2), k, v, attn_mask=mask, scale=self.scale)
            out[rows] = o[:, :, 0]
        return out

    def _prefill(self, q_nope, q_pe, kv_cache, chunk: PrefillChunk) -> torch.Tensor:
        """One prefill chunk (count queries) over its context (the cached latent and its own): (count, H, V)."""
        mla = self.mla
        latent = kv_cache[0][chunk.blocks].flatten(0, 2)[: chunk.context_len]  # (L, W)
        causal = chunk.mask is None  # a first chunk: plain causal; a later one carries its (count, L) mask
        if self._absorb_prefill(chunk.count):
            query = self._absorb_query(q_nope, q_pe).transpose(0, 1).unsqueeze(0)  # (1, H, count, W)
            ctx = latent[None, None]  # (1, 1, L, W)
            o = F.scaled_dot_product_attention(
                query,
                ctx,
                ctx[..., : mla.kv_lora_rank],
                attn_mask=chunk.mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            return self._unabsorb_output(o[0].transpose(0, 1))
        k, v = self._expand(latent)  # (H, L, N + P), (H, L, V)
        query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1).unsqueeze(0)  # (1, H, count, N + P)
        o = F.scaled_dot_product_attention(
            query, k.unsqueeze(0), v.unsqueeze(0), attn_mask=chunk.mask, is_causal=causal, scale=self.scale
        )
        return o[0].transpose(0, 1)

    def _absorb_prefill(self, count: int) -> bool:
        if self.form is not MLAForm.AUTO:
            return self.form is MLAForm.ABSORBED
        mla = self.mla
        absorbed = count * (mla.latent_width + mla.kv_lora_rank)  # per context token and head
        expanded = mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim)
        return absorbed < expanded


def _decode_groups(meta: AttentionMetadata, block_size: int):
    """The decode tokens as (rows, blocks (b, NB), mask (b, 1, 1, NB * B)) groups: the torch path's buckets, or
    the kernel layout's one padded group (MLA decode has no Triton kernel: it runs in torch either way)."""
    for d in meta.decodes:
        yield d.rows, d.blocks, d.mask
    kd = meta.kernel_decodes
    if kd is not None:
        slots = torch.arange(kd.blocks.shape[1] * block_size, device=kd.blocks.device)
        mask = (slots[None, :] < kd.context_lens[:, None]).view(kd.blocks.shape[0], 1, 1, -1)
        yield slice(0, meta.num_decodes), kd.blocks, mask
