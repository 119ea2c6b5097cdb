"""The attention layer: fused QKV projection, optional q/k norm, RoPE, paged attention, output projection."""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig, QKNorm
from shared.model.layers import RMSNorm, apply_rotary
from shared.model.linear import PackedWeights, linear
from shared.model.paged_attention import AttentionMetadata, paged_attention


class Attention(nn.Module, PackedWeights):
    LINEAR_WEIGHTS = ("qkv_proj", "o_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.clip_qkv = cfg.clip_qkv
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(qkv_rows)) if cfg.arch.qkv_bias else None
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size))
        self.qk_norm = cfg.arch.qk_norm
        if self.qk_norm is QKNorm.PER_HEAD:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif self.qk_norm is QKNorm.FULL:
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def checkpoint_shards(self) -> dict[str, tuple[str, tuple]]:
        q, kv = self.q_size, self.kv_size
        parts = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        shards = {f"{name}_proj.weight": ("qkv_proj", (rows,)) for name, rows in parts.items()}
        if self.qkv_bias is not None:
            shards |= {f"{name}_proj.bias": ("qkv_bias", (rows,)) for name, rows in parts.items()}
        return shards | {"o_proj.weight": ("o_proj", ())}

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # Rotary.tables() of this step's positions
        kv_cache: torch.Tensor,  # (2, N, B, KVH, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.w("qkv_proj"), self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm is QKNorm.FULL:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm is QKNorm.PER_HEAD:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return linear(out.reshape(t, self.q_size), self.w("o_proj"))
