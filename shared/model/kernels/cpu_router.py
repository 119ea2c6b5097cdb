"""The CPU MoE router selection kernel (cpu_router.c): softmax, top-A and the weights' renormalization of one
layer's float32 logits in one call instead of torch's five ops.

Built with gcc at first use into the kernel cache (cbuild.py), loaded with ctypes; plain C, any CPU gcc targets.
Where gcc is missing or the build fails, `load()` returns None after one log line and the torch ops run, which are
also the reference the kernel is tested against. The engine wires it in with `use_cpu_router_kernel`
(shared/model/routing.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from shared.model.kernels.cbuild import build_library, cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
MAX_TOP_K = 64  # MAX_TOP in the C source


def build() -> Path:
    """Compile the kernel into the cache now (raises if it cannot): a Docker image does this at build time."""
    return build_library(SOURCE, cache_dir())


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) where it cannot be built."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as exc:
        log.warning("CPU router kernel unavailable, using the torch ops: %s", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_route_f32.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ptr, ptr,
                                      ctypes.c_int]  # fmt: skip
    lib.pdserve_route_f32.restype = ctypes.c_int
    return lib


def route(
    lib: ctypes.CDLL, logits: torch.Tensor, top_k: int, topk_first: bool, renormalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) float32 on the CPU → (ids (T, top_k) int64, weights (T, top_k) float32), ids in descending
    order of their score. topk_first: select on the logits and softmax the chosen (renormalize and scale do
    not apply); else softmax over E, select, then weights / (their sum + 1e-20) if renormalize, times scale."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"the router kernel takes (T, E) float32 logits, got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"top-{top_k} of {e} experts: the kernel selects 1..min(E, {MAX_TOP_K})")
    logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    rc = lib.pdserve_route_f32(
        logits.data_ptr(), t, e, top_k, int(topk_first), int(renormalize), scale, ids.data_ptr(), weights.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"the router kernel refused top-{top_k} of {e}")
    return ids, weights
