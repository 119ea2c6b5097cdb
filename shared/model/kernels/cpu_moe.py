"""The CPU expert kernel (cpu_moe.c): one call per MoE layer for decode-sized batches, float32, AVX2 + FMA.

Built with gcc at first use into a cache directory (PDSERVE_KERNEL_CACHE, default ~/.cache/pdserve/kernels;
the file name carries a hash of the source and flags, so an edited source is rebuilt), loaded with ctypes.
Where gcc is missing, the build fails or the CPU lacks AVX2/FMA, `load()` returns None after one log line and
the experts keep the torch path (shared/model/moe.py), which is also the reference the kernel is tested against.

Weights are re-laid out once (`ExpertPanels`): a second copy of the experts, like oneDNN prepacking.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
# -fopenmp links libgomp.so.1: torch's CPU build loads its own libgomp under that soname first, so the kernel's
# parallel regions run on torch's OpenMP pool (one pool, no second set of spinning threads)
CFLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
GATE_UP_COLS, DOWN_COLS = 8, 16  # output columns per weight panel (cpu_moe.c: 2 x 8 and 16 floats per row)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def _build(source: Path, out_dir: Path) -> Path:
    """→ the shared library for `source`, compiled unless the cache holds it (atomic rename: concurrent
    builders of the same source race harmlessly)."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    if gcc is None:
        raise RuntimeError("no C compiler (gcc, or $CC) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([gcc, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{gcc} failed: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build() -> Path:
    """Compile the kernel into the cache now (raises if it cannot): a Docker image does this at build time, so
    its runtime, which has no compiler, finds the library in `PDSERVE_KERNEL_CACHE`."""
    return _build(SOURCE, cache_dir())


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) where it cannot be built or this CPU cannot run it."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as exc:
        log.warning("CPU expert kernel unavailable, using the torch path: %s", exc)
        return None
    if not lib.pdserve_cpu_supported():
        log.warning("CPU expert kernel needs AVX2 and FMA, which this CPU lacks: using the torch path")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_moe_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.pdserve_moe_f32.restype = ctypes.c_int
    return lib


def supports(hidden: int, intermediate: int, dtype: torch.dtype) -> str | None:
    """None when the kernel can compute experts of these sizes, else why not."""
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is float32 only)"
    if hidden % DOWN_COLS or intermediate % GATE_UP_COLS:
        return f"hidden {hidden} not a multiple of {DOWN_COLS} or intermediate {intermediate} of {GATE_UP_COLS}"
    return None


@dataclass(frozen=True)
class ExpertPanels:
    """The experts' weights in the kernel's panel layout (see cpu_moe.c). gate_up: (E, I/8, D, 16), each
    row k of panel j holding gate rows 8j..8j+8 then up rows 8j..8j+8 at column k; down: (E, D/16, I, 16)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def pack(cls, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertPanels:
        """gate_up (E, 2I, D), down (E, D, I): the Experts module's stacked weights."""
        e, two_i, d = gate_up.shape
        i = two_i // 2
        gate = gate_up[:, :i].reshape(e, i // GATE_UP_COLS, GATE_UP_COLS, d)
        up = gate_up[:, i:].reshape(e, i // GATE_UP_COLS, GATE_UP_COLS, d)
        gu = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()  # (E, I/8, D, 16)
        dn = down.reshape(e, d // DOWN_COLS, DOWN_COLS, i).transpose(2, 3).contiguous()  # (E, D/16, I, 16)
        # the kernel loads panels with aligned 32-byte loads: torch's CPU allocator aligns to 64 bytes
        assert gu.data_ptr() % 32 == 0 and dn.data_ptr() % 32 == 0
        return cls(gu.detach(), dn.detach())


def moe(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    panels: ExpertPanels,
    threads: int | None = None,
) -> torch.Tensor:
    """x (T, D) float32, topk_ids (T, A) int64, topk_weights (T, A) → (T, D): sum over a of
    topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t]), SiLU-gated experts, on `threads` threads (None =
    torch.get_num_threads(), the engine's intra-op count). The result is bitwise the same for any count."""
    assert x.dtype == torch.float32 and topk_ids.dtype == torch.int64
    x = x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    t, d = x.shape
    e, _, _, _ = panels.gate_up.shape
    i = panels.down.shape[2]
    out = torch.empty_like(x)
    rc = lib.pdserve_moe_f32(
        x.data_ptr(), t, d, i, e, ids.shape[1], ids.data_ptr(), weights.data_ptr(),
        panels.gate_up.data_ptr(), panels.down.data_ptr(), out.data_ptr(),
        torch.get_num_threads() if threads is None else threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("CPU expert kernel: scratch allocation failed")
    return out
