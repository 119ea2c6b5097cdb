"""The CPU paged decode attention kernel (cpu_attention.c): one call per layer for all decode tokens, float32,
reading each sequence's K/V blocks in place (AVX-512 or AVX2 + FMA, chosen at run time).

Built with gcc at first use into the kernel cache (cbuild.py), loaded with ctypes. Where gcc is missing, the
build fails or the CPU has neither ISA, `load()` returns None after one log line and decode attention keeps the
torch bucket path (shared/model/paged_attention.py), which is also the reference the kernel is tested against.
Not covered, so on the torch path: attention sinks (gpt-oss), dtypes other than float32, prefill chunks.
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
MIN_WIDTH = 8  # floats per vector of the narrowest ISA (AVX2): the head dim must be a multiple of it


def build() -> Path:
    """Compile the kernel into the cache now (raises if it cannot): a Docker image does this at build time, so
    its runtime, which has no compiler, finds the library in `PDSERVE_KERNEL_CACHE`."""
    return build_library(SOURCE, cache_dir())


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) where it cannot be built or this CPU cannot run it."""
    lib = load_library(SOURCE, log, "CPU attention kernel", "the torch path")
    if lib is None:
        return None
    if not lib.pdserve_attention_width():
        log.warning("CPU attention kernel needs AVX-512F or AVX2 + FMA, which this CPU lacks: using the torch path")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_paged_decode_f32.argtypes = [ptr, ptr, ptr, ptr, ptr, *[i64] * 8, ctypes.c_float, ctypes.c_int]
    lib.pdserve_paged_decode_f32.restype = ctypes.c_int
    lib.pdserve_write_paged_decode_f32.argtypes = [
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        *[i64] * 8,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.pdserve_write_paged_decode_f32.restype = ctypes.c_int
    return lib


def supports(head_dim: int, dtype: torch.dtype, has_sinks: bool) -> str | None:
    """None when the kernel can attend for a layer of this head dim and cache dtype, else why not."""
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is float32 only)"
    if has_sinks:
        return "attention sinks (not in the kernel)"
    if head_dim % MIN_WIDTH:
        return f"head dim {head_dim} not a multiple of {MIN_WIDTH}"
    return None


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q (Bd, H, hd) float32, one decode token per sequence; kv_cache (2, N, B, KVH, hd) float32 contiguous with
    this step's K/V written; blocks (Bd, NBmax) int64 block tables; context_lens (Bd,) int64 keys per sequence;
    window: keys more than window - 1 behind the query masked. → (Bd, H, hd), written into `out` when given
    (contiguous). `threads` None = torch.get_num_threads(); the result is bitwise the same for any count.
    write: (k, v, slots), this step's K/V rows (Bd, KVH, hd) float32, each token's heads contiguous (views of a
    fused projection are), and their (Bd,) int64 cache slots: written into the cache first, in the same call
    (paged_attention's index_copy_, bytewise); None = the caller wrote them."""
    if q.dtype != torch.float32 or kv_cache.dtype != torch.float32:
        raise ValueError(f"the CPU attention kernel is float32 only, got q {q.dtype}, cache {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("the CPU attention kernel reads the cache in place: it must be contiguous")
    bd, h, hd = q.shape
    _, n, b, kvh, _ = kv_cache.shape
    if h % kvh:
        raise ValueError(f"{h} query heads do not group over {kvh} KV heads")
    q = q.contiguous()
    # the metadata's tables are int64 already (KernelDecodes): no conversion op per layer then
    tables = blocks if blocks.dtype == torch.int64 else blocks.to(torch.int64)
    lens = context_lens if context_lens.dtype == torch.int64 else context_lens.to(torch.int64)
    tables, lens = tables.contiguous(), lens.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape:
        raise ValueError("out must be contiguous and shaped like q")
    threads = torch.get_num_threads() if threads is None else threads
    if write is None:
        rc = lib.pdserve_paged_decode_f32(
            q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            bd, h, kvh, hd, n, b, tables.shape[1], window or 0, scale, threads,
        )  # fmt: skip
    else:
        k, v, slots = write
        for name, x in (("k", k), ("v", v)):
            if x.dtype != torch.float32 or x.shape != (bd, kvh, hd) or x.stride(2) != 1 or x.stride(1) != hd:
                raise ValueError(f"{name} must be float32 ({bd}, {kvh}, {hd}) with contiguous heads")
        if slots.dtype != torch.int64 or slots.shape != (bd,) or not slots.is_contiguous():
            raise ValueError(f"slots must be ({bd},) contiguous int64")
        rc = lib.pdserve_write_paged_decode_f32(
            q.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
            kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            bd, h, kvh, hd, n, b, tables.shape[1], window or 0, scale, threads,
        )  # fmt: skip
    if rc == -2:
        raise IndexError(f"a K/V slot outside the cache's {n * b} slots")
    if rc != 0:
        raise ValueError(f"the CPU attention kernel cannot run head dim {hd} on this CPU")
    return out
