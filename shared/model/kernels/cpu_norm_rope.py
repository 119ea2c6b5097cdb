"""The CPU RMSNorm and q/k norm + RoPE kernel (cpu_norm_rope.c): one call per norm (with the residual add before
it, where the layer has one) and one per attention layer's q/k instead of torch's five ops each, float32.

Built with gcc at first use into the kernel cache (cbuild.py), loaded with ctypes; any x86-64 CPU runs it (the
library carries AVX-512F, AVX2 and plain builds and picks one at load). Where gcc is missing or the build fails,
`load()` returns None after one log line and the torch ops run, which are also the reference the kernel is
tested against. The engine wires it in with `use_cpu_norm_rope_kernel` (shared/model/attention.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from shared.model.kernels.cbuild import build_library, cache_dir, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")


def build() -> Path:
    """Compile the kernel into the cache now (raises if it cannot): a Docker image does this at build time."""
    return build_library(SOURCE, cache_dir())


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) where it cannot be built."""
    lib = load_library(SOURCE, log, "CPU norm kernel", "the torch ops")
    if lib is None:
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.pdserve_rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i32]
    lib.pdserve_rms_norm_f32.restype = None
    lib.pdserve_add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.pdserve_add_rms_norm_f32.restype = None
    lib.pdserve_qk_norm_rope_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, *[i64] * 5, i32]
    lib.pdserve_qk_norm_rope_f32.restype = None
    return lib


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of x seen as a matrix of its last dim, when its last dim is contiguous and every row
    lies one stride after the previous (a contiguous tensor, or a column slice of one); None otherwise."""
    if x.is_contiguous():  # the common case, without the walk below (this runs per norm per step)
        return x.numel() // x.shape[-1], x.shape[-1]
    if x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return 1, x.shape[0]
    rows, stride = x.shape[-2], x.stride(-2)
    for size, st in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2]), strict=True):
        if size != 1 and st != rows * stride:
            return None
        rows *= size
    return rows, stride


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's last dim (float32 on the CPU), a new contiguous tensor; None when x's layout is not one
    the kernel reads (the caller runs the torch ops)."""
    layout = _rows(x)
    if layout is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    rows, stride = layout
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.pdserve_rms_norm_f32(
        x.data_ptr(), stride, weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], eps, torch.get_num_threads()
    )
    return out


def add_rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, RMSNorm of it) in one pass, float32 on the CPU, both new contiguous tensors; None when the
    inputs are not contiguous float32 of one shape (the caller runs the torch ops)."""
    if not (x.dtype == delta.dtype == weight.dtype == torch.float32 and x.shape == delta.shape):
        return None
    if not (x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous()):
        return None
    n = x.shape[-1]
    h, out = torch.empty_like(x), torch.empty_like(x)
    lib.pdserve_add_rms_norm_f32(
        x.data_ptr(), delta.data_ptr(), weight.data_ptr(), h.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return h, out


def qk_norm_rope(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, hd), k (T, KVH, hd) float32, each head contiguous and its heads one after another in a token's
    row (views of a fused projection are); cos, signed_sin (T, 1, dim) or (T, dim) with dim <= hd (RopeTables);
    q_weight, k_weight (hd,): a per-head RMSNorm before the rotation, or both None. → rotated (q, k), new
    contiguous tensors: apply_rotary(q_norm(q), k_norm(k), tables)."""
    t, h, hd = q.shape
    kvh = k.shape[1]
    for name, x in (("q", q), ("k", k)):
        if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != hd:
            raise ValueError(f"{name} must be float32 with contiguous heads, got {x.dtype}, strides {x.stride()}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q and k are normed together or not at all")
    dim = cos.shape[-1]
    # the kernel reads (T, dim) rows: a contiguous (T, 1, dim) table is that already (no reshape, two ops a layer)
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.numel() == signed_sin.numel() == t * dim):
        cos, signed_sin = cos.reshape(t, dim).contiguous(), signed_sin.reshape(t, dim).contiguous()
    if dim > hd or dim % 2:
        raise ValueError(f"rotary tables of width {dim} for a head dim of {hd}")
    # held in names until the call returns: a temporary's memory could be reused while the kernel reads it
    q_w = None if q_weight is None else q_weight.contiguous()
    k_w = None if k_weight is None else k_weight.contiguous()
    q_out = torch.empty(t, h, hd, dtype=q.dtype)
    k_out = torch.empty(t, kvh, hd, dtype=k.dtype)
    lib.pdserve_qk_norm_rope_f32(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
        None if q_w is None else q_w.data_ptr(), None if k_w is None else k_w.data_ptr(),
        eps, cos.data_ptr(), signed_sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
        t, h, kvh, hd, dim, torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out
