"""Fused MoE: the routed experts as two grouped GEMMs over expert-sorted (token, expert) pairs (Triton).

Shape legend (as moe.py): T tokens, D hidden, E experts, A experts per token (top-k), I expert intermediate
size, P = T*A pairs; pair p = t*A + a is token t's a-th choice. BM = block_m rows of pairs per block.

1. `align_pairs` (torch ops on the device, no host sync): sort the P pairs by expert and pad each expert's
   group to a multiple of BM ("moe_align_block_size" in vLLM/SGLang) → sorted pair ids, one expert per block,
   the padded row count. An expert no token chose gets no block.
2. `_gate_up_kernel`, per (block, I tile): x[token] @ gate_up[e].T for the tile's gate columns and the matching
   up columns, SiLU(gate) * up in the epilogue → h (P, I), row = pair id.
3. `_down_kernel`, per (block, D tile): h[pair] @ down[e].T * routing weight → y (P, D), row = pair id.
4. Combine: token t owns exactly the A rows t*A .. t*A+A-1 of y, so out = y.view(T, A, D).sum(1): no atomics.

Why the activation sits in kernel 1's epilogue: one program computes the gate tile and the up tile of the same
I columns (two accumulators sharing every x load), so SiLU(gate) * up is elementwise in registers; the
(P, 2I) intermediate never reaches memory and no third launch is needed. The price is a second accumulator.

The grid cannot know the padded count without reading it on the host, so it is launched for the bound
`max_blocks` and programs past `num_padded` return at once (a no-op program, not a GEMM).
Shared experts are not here: they stay a dense MLP that moe.MoE.forward adds outside the routed experts.
Tile sizes are plain defaults, not tuned on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DEFAULT_BLOCK_M = 16  # tl.dot needs every tile side >= 16


class ExpertBlocks(NamedTuple):
    """The P pairs laid out for the grouped GEMMs; every tensor stays on the device of topk_ids.

    Invariant: rows [b*BM, (b+1)*BM) of sorted_pair_ids all belong to expert block_expert_ids[b]; a padding row
    holds P (one past the last pair id), which the kernels mask. Blocks at or past num_padded / BM are unused.
    """

    sorted_pair_ids: torch.Tensor  # (max_blocks * BM,) int64
    block_expert_ids: torch.Tensor  # (max_blocks,) int64; unused blocks hold E-1 so any read stays in bounds
    num_padded: torch.Tensor  # (1,) int64: rows in use, a multiple of BM


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv, typed as returning a constexpr


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the blocks `align_pairs` fills: each non-empty expert adds at most BM-1 padding rows."""
    return _cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = DEFAULT_BLOCK_M) -> ExpertBlocks:
    """Group the (token, expert) pairs of topk_ids (T, A) by expert, each group padded to a multiple of block_m.

    Only device ops with sizes known from shapes: no `.item()`, no `bincount` (which reads the max on CUDA).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # scatter_add_ takes int64 indices
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)  # padded group e occupies [padded_ends[e] - padded[e], padded_ends[e])
    order = flat.argsort(stable=True)  # pair ids, grouped by expert
    expert = flat[order]
    # sorted position i of expert e's group moves to: padded start of e + (i - unpadded start of e)
    shift = (padded_ends - padded) - (counts.cumsum(0) - counts)  # (E,)
    dest = torch.arange(num_pairs, device=device) + shift[expert]
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_starts = torch.arange(0, blocks * block_m, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_ids, block_expert, padded_ends[-1:])


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_xd, stride_we, stride_wn, stride_wd, stride_hp, stride_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (block of BM pairs, BLOCK_N columns of I) tile of h = SiLU(x @ gate.T) * (x @ up.T)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + block)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,)
    row_ok = pairs < num_pairs
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) columns of I
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd  # (BM, BK)
    gate_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wd  # (BK, BN): gate_up[e].T
    up_ptrs = gate_ptrs + inter * stride_wn  # the up rows sit I rows below the gate rows
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        xs = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc_gate = tl.dot(xs, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(xs, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up, in fp32
    h_ptrs = h_ptr + pairs[:, None] * stride_hp + cols[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter,
    stride_hp, stride_hi, stride_we, stride_wn, stride_wk, stride_yp, stride_yd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (block of BM pairs, BLOCK_N columns of D) tile of y = routing weight * (h @ down.T)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + block)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) columns of D
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None] * stride_hp + ks[None, :] * stride_hi  # (BM, BK)
    w_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk  # (BK, BN): down[e].T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        hs = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(hs, ws, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K * stride_hi
        w_ptrs += BLOCK_K * stride_wk
    # Like moe.py: the routing weight is cast to the activation dtype before it scales the expert's output.
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    y_ptrs = y_ptr + pairs[:, None] * stride_yp + cols[None, :] * stride_yd
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tile(n: int) -> int:
    """A tile side for a dimension of size n: a power of two in [16, 64] (tl.dot's minimum; untuned maximum)."""
    return max(16, min(64, 1 << (n - 1).bit_length()))


def _check_inputs(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> None:
    """ValueError unless the shapes fit the legend and the weights share x's dtype (the kernels do not cast them)."""
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but gate_up is {gate_up.dtype} and down {down.dtype}")
    t, d = x.shape
    e, two_i, d_w = gate_up.shape
    if d_w != d or two_i % 2 or tuple(down.shape) != (e, d, two_i // 2):
        raise ValueError(f"weights gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} do not fit x (T, {d})")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}: need (T={t}, A)")


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int = DEFAULT_BLOCK_M,
) -> torch.Tensor:
    """x (T, D), gate_up (E, 2I, D), down (E, D, I), topk_ids (T, A), topk_weights (T, A) → (T, D) in x.dtype.

    The routed experts only (no shared expert). Allocates h (P, I) and y (P, D) scratch; launches two kernels.
    """
    _check_inputs(x, gate_up, down, topk_ids, topk_weights)
    (t, d), (e, two_i, _), a = x.shape, gate_up.shape, topk_ids.shape[1]
    inter, num_pairs = two_i // 2, t * a
    if num_pairs == 0:
        return torch.zeros_like(x)
    blocks = align_pairs(topk_ids, e, block_m)
    grid_m = blocks.block_expert_ids.numel()
    # fp32 inputs: full-precision dots, so fp32 results match torch (tf32 would not); ignored for bf16/fp16.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    # the ignores below: triton types a kernel's constexpr parameters as tl.constexpr; launches pass plain values
    bn, bk = _tile(inter), _tile(d)
    _gate_up_kernel[(grid_m, _cdiv(inter, bn))](
        x, gate_up, h, blocks.sorted_pair_ids, blocks.block_expert_ids, blocks.num_padded,
        num_pairs, a, d, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision,  # pyright: ignore[reportArgumentType]
    )  # fmt: skip
    y = torch.empty(num_pairs, d, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()  # (P,), pair order
    bn, bk = _tile(d), _tile(inter)
    _down_kernel[(grid_m, _cdiv(d, bn))](
        h, down, y, weights, blocks.sorted_pair_ids, blocks.block_expert_ids, blocks.num_padded,
        num_pairs, d, inter,
        h.stride(0), h.stride(1), down.stride(0), down.stride(1), down.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision,  # pyright: ignore[reportArgumentType]
    )  # fmt: skip
    return y.view(t, a, d).sum(dim=1)


def fused_moe_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Plain torch, one expert at a time: the math of experts.Experts.forward_reference (the same gated MLP as
    layers.gated_mlp, written out here: the kernels sit below the model's layers; routing weight cast to x.dtype
    before it scales the expert output, summed into the token)."""
    _check_inputs(x, gate_up, down, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel():
            gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e])
            out.index_add_(0, tokens, topk_weights[tokens, slots].to(x.dtype).unsqueeze(1) * y)
    return out
