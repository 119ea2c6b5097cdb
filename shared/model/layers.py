"""Small building blocks shared by every architecture: RMSNorm, rotary embedding, gated MLP.

Tensors are flat over tokens: `T` tokens of the whole batch, `D` hidden size, no padding.
"""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import RopeConfig
from shared.model.kernels import cpu_norm_rope
from shared.model.linear import PackedWeights, WeightFormat, linear
from shared.model.tensor_parallel import TensorShard


class RMSNorm(nn.Module):
    """Normalize in float32. Llama's order (the default) casts back to the activations' dtype before the
    weight; `weight_in_float32` (gpt-oss) scales by the weight in float32 and casts once after it, one
    rounding instead of two below float32, as transformers' GptOssRMSNorm does."""

    def __init__(self, dim: int, eps: float, weight_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        # the CPU norm kernel (kernels/cpu_norm_rope.py), set by use_cpu_norm_rope_kernel on a float32 CPU model
        self.kernel: ctypes.CDLL | None = None

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None):
        """→ the norm of x; with `residual_delta`, (h, the norm of h) for h = x + residual_delta: the residual add
        before a norm, in one pass where the CPU kernel runs (the same h, bitwise, as x + residual_delta)."""
        if residual_delta is None:
            return self._norm(x)
        if self.kernel is not None and x.device.type == "cpu" and self.weight.dtype == torch.float32:
            fused = cpu_norm_rope.add_rms_norm(self.kernel, x, residual_delta, self.weight, self.eps)
            if fused is not None:  # None: a layout or dtype the kernel does not take
                return fused
        h = x + residual_delta
        return h, self._norm(h)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            if self.kernel is not None:
                out = cpu_norm_rope.rms_norm(self.kernel, x, self.weight, self.eps)
                if out is not None:  # None: a layout the kernel does not read
                    return out
            # one fused op instead of eight: on CPU in float32 bitwise the lines below (no casts to round at;
            # checked over widths 64..7168, 1..512 rows, 1 and 2 threads). Other devices keep the ops transformers
            # runs (a CUDA fused kernel need not sum in their order).
            return F.rms_norm(x, [x.shape[-1]], self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (self.weight * x32).to(dtype)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position: non-persistent buffers, so they follow the model to its
    device (`.to`, `to_empty`) and never travel in a checkpoint. `fill()` computes them (`CausalLM.init_runtime`).

    Partial rotary (`rope.partial_rotary_factor` < 1, GLM-4.5): the tables cover only the first `dim` =
    rotary_dim of each head's dims; `apply_rotary` rotates those and passes the rest through."""

    cos: torch.Tensor  # (P, dim) buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.dim, self.max_position, self.rope = rope.rotary_dim(head_dim), max_position, rope
        self.register_buffer("cos", torch.empty(max_position, self.dim), persistent=False)  # (P, dim)
        self.register_buffer("sin", torch.empty(max_position, self.dim), persistent=False)

    @torch.no_grad()
    def fill(self) -> None:
        """Compute the tables in float32 on the host (the same numbers on every device), copy them in once.
        They stay float32 under a model in a lower dtype (the `.to(dtype)` at load casts buffers too): `tables`
        casts its rows to the dtype asked for, and DeepSeek-V2 rotates with the float32 ones."""
        if self.cos.dtype != torch.float32:
            self.cos = torch.empty_like(self.cos, dtype=torch.float32)
            self.sin = torch.empty_like(self.sin, dtype=torch.float32)
        hd = self.dim
        inv_freq = 1.0 / (self.rope.theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        mscale = 1.0
        if self.rope.kind == "yarn":
            inv_freq, mscale = yarn_inv_freq_and_mscale(hd, self.rope)
        else:
            inv_freq = _scale_inv_freq(inv_freq, self.rope)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, dim)
        # YaRN's attention factor scales cos and sin (so q·k by its square), as transformers applies it
        self.cos.copy_(emb.cos() * mscale)
        self.sin.copy_(emb.sin() * mscale)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos, sin for these positions (on the tables' device), (T, 1, dim) each: looked up once per step,
        shared by all layers."""
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return RopeTables(
            self.cos[positions].unsqueeze(1).to(dtype), sin, torch.cat((-sin[..., :half], sin[..., half:]), -1)
        )


class RopeTables(NamedTuple):
    """One step's rotary tables, (T, 1, dim) each (Rotary.tables)."""

    cos: torch.Tensor
    sin: torch.Tensor
    # sin with its first half negated: rotate_half(x) * sin == x.roll(dim / 2, -1) * signed_sin, bitwise (a sign
    # moves between factors exactly), in one op per tensor instead of rotate_half's four (two slices, neg, cat)
    signed_sin: torch.Tensor


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, hd), k: (T, KVH, hd), rope: Rotary.tables(...) → rotated q, k (new tensors): x * cos +
    rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) of x's halves, as transformers writes it. Tables narrower
    than hd (partial rotary): the first `dim` dims of each head rotate, the others are kept as they are."""
    cos, signed_sin = rope.cos, rope.signed_sin
    dim = cos.shape[-1]
    if dim == q.shape[-1]:
        return q * cos + q.roll(dim // 2, -1) * signed_sin, k * cos + k.roll(dim // 2, -1) * signed_sin
    q_rot, q_pass = q[..., :dim], q[..., dim:]
    k_rot, k_pass = k[..., :dim], k[..., dim:]
    q_rot = q_rot * cos + q_rot.roll(dim // 2, -1) * signed_sin
    k_rot = k_rot * cos + k_rot.roll(dim // 2, -1) * signed_sin
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


def apply_rotary_interleaved(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's layout), each pair rotated by one frequency.
    The result is de-interleaved: [rotated x0, x2, ... | rotated x1, x3, ...]. That permutes the rope dimensions
    the same way for queries and keys, so every q.k (all attention reads of them) is the pairwise rotation's."""
    half = rope.cos.shape[-1] // 2
    cos, sin = rope.cos[..., :half], rope.sin[..., :half]  # the tables are cat(freqs, freqs): one angle per pair

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        # float32 tables (DeepSeek-V2) promote the products: one rounding back to x's dtype, after the sums
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def yarn_inv_freq_and_mscale(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' `_compute_yarn_parameters`: → inv_freq (dim/2,) float32 and the
    attention factor that multiplies cos/sin. Frequencies that rotate fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those rotating more than `beta_fast` times are kept,
    with a linear ramp between; `truncate` rounds the ramp's ends to whole dimensions."""
    base, factor = rope.theta, rope.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale = rope.attention_factor
    if mscale is None:
        if rope.mscale and rope.mscale_all_dim:
            mscale = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            mscale = get_mscale(factor)
    return inv_freq, float(mscale)


def _scale_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class GatedMLP(nn.Module, PackedWeights):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one (2I, D) weight.

    Tensor-parallel: this rank holds 1/tp of the intermediate size (gate/up rows, down columns) and its output
    is a partial sum, all-reduced here unless `reduce` is off (the MoE's shared expert: the MoE block reduces
    its routed and shared outputs together, once)."""

    LINEAR_WEIGHTS = ("gate_up_proj", "down_proj")

    def __init__(
        self, hidden: int, intermediate: int, shard: TensorShard = TensorShard.SINGLE, reduce: bool = True
    ) -> None:
        super().__init__()
        self.shard, self.reduce = shard, reduce
        self.rows = shard.part(intermediate, "the MLP's intermediate size")  # this rank's intermediate rows
        self.intermediate = len(self.rows)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * self.intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, self.intermediate))

    # Checkpoint tensor (relative name) → (our parameter, the slice of it that tensor fills, the slice of the
    # checkpoint tensor this rank reads: () = all of it).
    def checkpoint_shards(self) -> dict[str, tuple]:
        i, src = self.intermediate, self.shard.source
        return {
            "gate_proj.weight": ("gate_up_proj", (slice(0, i),), src(self.rows)),
            "up_proj.weight": ("gate_up_proj", (slice(i, 2 * i),), src(self.rows)),
            "down_proj.weight": ("down_proj", (), src(None, self.rows)),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = gated_mlp(x, self.w("gate_up_proj"), self.w("down_proj"))
        return self.shard.all_reduce_(out) if self.reduce else out


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor | WeightFormat, down: torch.Tensor | WeightFormat) -> torch.Tensor:
    """x: (T, D), gate_up: (2I, D), down: (D, I) → (T, D). Weights may be packed (see linear.py)."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up), down)  # in place: one (T, I) buffer fewer per call, same rounding
