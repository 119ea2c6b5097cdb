"""The attention layer: fused QKV projection, optional q/k norm, RoPE, paged attention, output projection.

Tensor-parallel (shard.tp > 1): this rank computes its query heads and holds its KV heads (replicated when there
are fewer KV heads than ranks, shared/sharding/layout.py); qkv_proj holds only their rows, o_proj only their
input columns (row-parallel), and the output is all-reduced. A FULL q/k norm needs the variance over the whole
projection width: the per-token sums of squares are all-reduced (one (T, 2) all-reduce for q and k).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from shared.model.config import ModelConfig, QKNorm
from shared.model.kernels import cpu_attention, cpu_norm_rope
from shared.model.layers import RMSNorm, RopeTables, apply_rotary
from shared.model.linear import PackedWeights, linear
from shared.model.mla_attention import MLAAttention
from shared.model.paged_attention import AttentionMetadata, paged_attention
from shared.model.tensor_parallel import TensorShard
from shared.sharding.layout import head_range, kv_head_holders, kv_head_range


class Attention(nn.Module, PackedWeights):
    LINEAR_WEIGHTS = ("qkv_proj", "o_proj")

    def __init__(self, cfg: ModelConfig, shard: TensorShard = TensorShard.SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.shard = shard
        self.window = cfg.window_of(layer)  # this layer's sliding window, None = full attention
        hd = cfg.head_dim
        heads = head_range(cfg.num_heads, shard.tp, shard.rank)
        kv_heads = kv_head_range(cfg.num_kv_heads, shard.tp, shard.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = len(heads), len(kv_heads), hd
        self.q_size = self.num_heads * hd  # this rank's width (the whole projection at tp = 1)
        self.kv_size = self.num_kv_heads * hd
        # the rows of the checkpoint's q_proj and k_proj/v_proj this rank holds
        self.q_rows = range(heads.start * hd, heads.stop * hd)
        self.kv_rows = range(kv_heads.start * hd, kv_heads.stop * hd)
        self.scale = hd**-0.5
        self.clip_qkv = cfg.clip_qkv
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(qkv_rows)) if cfg.arch.qkv_bias else None
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size))
        # row-parallel o_proj: its bias is added once, after the all-reduce
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size)) if cfg.arch.o_bias else None
        self.head_rows = heads  # this rank's query heads: its slice of the per-head sinks
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.arch.attention_sinks else None
        self.qk_norm = cfg.arch.qk_norm
        # the CPU q/k norm + RoPE kernel (kernels/cpu_norm_rope.py), set by use_cpu_norm_rope_kernel
        self.rope_kernel: ctypes.CDLL | None = None
        if self.qk_norm is QKNorm.PER_HEAD:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        elif self.qk_norm is QKNorm.FULL:
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
            self.full_q_size, self.full_kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
            # a replicated KV head is in the k-norm's variance once: only its first holder counts it
            first_holder = kv_head_holders(cfg.num_kv_heads, shard.tp)[kv_heads.start][0] == shard.rank
            self.k_counts = 1.0 if first_holder else 0.0

    def checkpoint_shards(self) -> dict[str, tuple]:
        q, kv = self.q_size, self.kv_size
        parts = {
            "q": (slice(0, q), self.q_rows),
            "k": (slice(q, q + kv), self.kv_rows),
            "v": (slice(q + kv, q + 2 * kv), self.kv_rows),
        }
        src = self.shard.source
        shards: dict[str, tuple] = {
            f"{name}_proj.weight": ("qkv_proj", (rows,), src(cut)) for name, (rows, cut) in parts.items()
        }
        if self.qkv_bias is not None:
            shards |= {f"{name}_proj.bias": ("qkv_bias", (rows,), src(cut)) for name, (rows, cut) in parts.items()}
        if self.qk_norm is QKNorm.FULL:
            shards |= {
                "q_norm.weight": ("q_norm.weight", (), src(self.q_rows)),
                "k_norm.weight": ("k_norm.weight", (), src(self.kv_rows)),
            }
        if self.sinks is not None:
            shards["sinks"] = ("sinks", (), src(self.head_rows))
        if self.o_bias is not None:
            shards["o_proj.bias"] = ("o_bias", ())
        return shards | {"o_proj.weight": ("o_proj", (), src(None, self.q_rows))}

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,  # Rotary.tables() of this step's positions
        kv_cache: torch.Tensor,  # (2, N, B, KVH, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.w("qkv_proj"), self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm is QKNorm.FULL:
            q, k = self._full_qk_norm(q, k) if self.shard.split else (self.q_norm(q), self.k_norm(k))
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        # views of the projection's columns (no copy): a head's dims are contiguous in each token's row
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.rope_kernel is not None:  # the per-head norm and the rotation in one call
            weights = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm is QKNorm.PER_HEAD else (None, None)
            eps = self.q_norm.eps if self.qk_norm is QKNorm.PER_HEAD else 0.0
            q, k = cpu_norm_rope.qk_norm_rope(self.rope_kernel, q, k, rope.cos, rope.signed_sin, *weights, eps)
        else:
            if self.qk_norm is QKNorm.PER_HEAD:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, rope)
        out = paged_attention(q, k, v, kv_cache, meta.for_window(self.window), self.scale, self.sinks)
        out = out.view(t, self.q_size)  # paged_attention's output is a new contiguous tensor
        if not self.shard.split:  # the bias inside the matmul: one rounding, as nn.Linear's (transformers')
            return linear(out, self.w("o_proj"), self.o_bias)
        out = self.shard.all_reduce_(linear(out, self.w("o_proj")))  # the bias is whole-row: added once, after
        return out if self.o_bias is None else out + self.o_bias

    def _full_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of this rank's columns of q (T, q_size) and k (T, kv_size) with the variance over the whole
        width: the sums of squares of every rank, all-reduced. The same float32 arithmetic as RMSNorm."""
        q32, k32 = q.float(), k.float()
        squares = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1) * self.k_counts], dim=-1)  # (T, 2)
        self.shard.all_reduce_(squares)
        eps = self.q_norm.eps
        q32 = q32 * torch.rsqrt(squares[:, :1] / self.full_q_size + eps)
        k32 = k32 * torch.rsqrt(squares[:, 1:] / self.full_kv_size + eps)
        return self.q_norm.weight * q32.to(q.dtype), self.k_norm.weight * k32.to(k.dtype)


class AttentionKernelHost(Protocol):
    """The model use_cpu_attention_kernel sets up (transformer.py's CausalLM; named by shape, not imported: the
    model imports its layers, never the reverse)."""

    cpu_attention: bool  # decode attention through the CPU kernel, in every layer or none

    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def use_cpu_attention_kernel(model: AttentionKernelHost) -> str:
    """Set `model.cpu_attention` (CausalLM) when every attention layer can run its decode tokens through the CPU
    attention kernel (float32, no sinks, a head dim of a multiple of 8, gcc at hand, AVX-512 or AVX2 + FMA);
    → a line for the engine's log saying what was chosen. All layers or none: the step's metadata is one
    layout for every layer."""
    model.cpu_attention = False
    layers = list(model.modules())
    if any(isinstance(m, MLAAttention) for m in layers):
        return "torch (latent attention: no kernel)"
    attention = [m for m in layers if isinstance(m, Attention)]
    if not attention:
        return "torch (no attention layers)"
    dtype = next(model.parameters()).dtype
    refused = {why for m in attention if (why := cpu_attention.supports(m.head_dim, dtype, m.sinks is not None))}
    if refused:
        return f"torch ({'; '.join(sorted(refused))})"
    if cpu_attention.load() is None:
        return "torch (the kernel could not be built or run here, see the warning above)"
    model.cpu_attention = True
    return f"cpu kernel in {len(attention)} layers"


def use_cpu_norm_rope_kernel(model: nn.Module) -> str:
    """Give every RMSNorm of a float32 model the CPU norm kernel and every (non-latent) attention layer the
    fused q/k norm + RoPE (kernels/cpu_norm_rope.py); → a line for the engine's log. Other dtypes, or a host
    where the kernel cannot be built, keep the torch ops."""
    dtype = next(model.parameters()).dtype
    lib = cpu_norm_rope.load() if dtype == torch.float32 else None
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    fused = [m for m in model.modules() if isinstance(m, Attention)]
    for m in norms:
        m.kernel = lib
    for m in fused:
        m.rope_kernel = lib
    if dtype != torch.float32:
        return f"torch ops (dtype {dtype}: the kernel is float32 only)"
    if lib is None:
        return "torch ops (the kernel could not be built here, see the warning above)"
    return f"cpu kernel for {len(norms)} norms and the q/k norm + RoPE of {len(fused)} attention layers"
