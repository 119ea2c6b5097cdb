"""The CPU expert kernel (cpu_moe.c): one call per MoE layer for decode-sized batches, float32, in two builds of
one source: AVX-512F (vectors of 16 floats, 12-row tiles, software prefetch) and AVX2 + FMA (8 floats, 6 rows).
Both give the same bits; `kernels()` lists those this CPU runs, the widest first.

Each is built with gcc at first use into a cache directory (PDSERVE_KERNEL_CACHE, default
~/.cache/pdserve/kernels; the file name carries the ISA and a hash of the source and flags, so an edited source
is rebuilt), loaded with ctypes. Where gcc is missing, the build fails or the CPU lacks AVX2/FMA, `kernels()` is
empty after one log line and the experts keep the torch path (shared/model/moe.py), which is also the reference
the kernel is tested against. `PDSERVE_CPU_KERNEL_ISA=avx2` keeps a CPU with AVX-512 on the AVX2 build.

Weights are re-laid out once (`ExpertPanels`): a second copy of the experts, like oneDNN prepacking.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.kernels.cbuild import build_library, cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
# compiled with cbuild.CFLAGS (no -m flags: the source picks its vector ISA with #pragma GCC target, so its CPU
# check runs anywhere) and -DPDSERVE_ISA per build
ISAS = {"avx512": 512, "avx2": 256}  # build name → PDSERVE_ISA, the widest first


def _build(source: Path, out_dir: Path, isa: str = "avx2", extra: tuple[str, ...] = ()) -> Path:
    """→ the shared library for `source` built for `isa` (plus `extra` compiler flags: a benchmark's variant),
    compiled unless the cache holds it (cbuild.build_library)."""
    return build_library(source, out_dir, (f"-DPDSERVE_ISA={ISAS[isa]}", *extra), tag=isa)


def build() -> list[Path]:
    """Compile every build into the cache now (raises if one cannot): a Docker image does this at build time,
    so its runtime, which has no compiler, finds the libraries in `PDSERVE_KERNEL_CACHE`."""
    return [_build(SOURCE, cache_dir(), isa) for isa in ISAS]


@dataclass(frozen=True)
class ExpertPanels:
    """The experts' weights in one build's panel layout (see cpu_moe.c), L = `lanes` floats per vector.
    gate_up: (E, I/L, D, 2L), row k of panel j holding gate rows Lj..Lj+L then up rows Lj..Lj+L at column k;
    down: (E, D/2L, I, 2L)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    lanes: int

    @classmethod
    def pack(cls, gate_up: torch.Tensor, down: torch.Tensor, lanes: int) -> ExpertPanels:
        """gate_up (E, 2I, D), down (E, D, I): the Experts module's stacked weights."""
        e, two_i, d = gate_up.shape
        i = two_i // 2
        gate = gate_up[:, :i].reshape(e, i // lanes, lanes, d)
        up = gate_up[:, i:].reshape(e, i // lanes, lanes, d)
        gu = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()  # (E, I/L, D, 2L)
        dn = down.reshape(e, d // (2 * lanes), 2 * lanes, i).transpose(2, 3).contiguous()  # (E, D/2L, I, 2L)
        # the kernel loads panel rows with aligned 4L-byte loads: torch's CPU allocator aligns to 64 bytes
        assert gu.data_ptr() % (4 * lanes) == 0 and dn.data_ptr() % (4 * lanes) == 0
        return cls(gu.detach(), dn.detach(), lanes)


@dataclass(frozen=True)
class Kernel:
    """One loaded build of cpu_moe.c."""

    lib: ctypes.CDLL
    isa: str  # a key of ISAS
    lanes: int  # floats per vector: L of the panel layout

    def supports(self, hidden: int, intermediate: int, dtype: torch.dtype) -> str | None:
        """None when this build can compute experts of these sizes, else why not."""
        if dtype != torch.float32:
            return f"dtype {dtype} (the kernel is float32 only)"
        if hidden % (2 * self.lanes) or intermediate % self.lanes:
            return (f"hidden {hidden} not a multiple of {2 * self.lanes} or intermediate {intermediate} of "
                    f"{self.lanes} ({self.isa})")  # fmt: skip
        return None

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertPanels:
        return ExpertPanels.pack(gate_up, down, self.lanes)

    def moe(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        panels: ExpertPanels,
        threads: int | None = None,
    ) -> torch.Tensor:
        """x (T, D) float32, topk_ids (T, A) int64, topk_weights (T, A) → (T, D): sum over a of
        topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t]), SiLU-gated experts, on `threads` threads (None =
        torch.get_num_threads(), the engine's intra-op count). The result is bitwise the same for any count."""
        assert x.dtype == torch.float32 and topk_ids.dtype == torch.int64 and panels.lanes == self.lanes
        x = x.contiguous()
        ids = topk_ids.contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        t, d = x.shape
        e, _, _, _ = panels.gate_up.shape
        i = panels.down.shape[2]
        out = torch.empty_like(x)
        rc = self.lib.pdserve_moe_f32(
            x.data_ptr(), t, d, i, e, ids.shape[1], ids.data_ptr(), weights.data_ptr(),
            panels.gate_up.data_ptr(), panels.down.data_ptr(), out.data_ptr(),
            torch.get_num_threads() if threads is None else threads,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("CPU expert kernel: scratch allocation failed")
        return out


def load_build(isa: str, extra: tuple[str, ...] = ()) -> Kernel | None:
    """Build `isa` (with `extra` flags) and load it; None where this CPU cannot run it. Raises RuntimeError or
    OSError where it cannot be built or loaded."""
    lib = ctypes.CDLL(str(_build(SOURCE, cache_dir(), isa, extra)))
    if not lib.pdserve_cpu_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_moe_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.pdserve_moe_f32.restype = ctypes.c_int
    return Kernel(lib, isa, lib.pdserve_lanes())


@functools.cache
def kernels() -> tuple[Kernel, ...]:
    """The builds this CPU runs, the widest first (only `PDSERVE_CPU_KERNEL_ISA`'s when that is set); empty,
    logged once, where none can be built or run."""
    wanted = os.environ.get("PDSERVE_CPU_KERNEL_ISA") or None
    if wanted is not None and wanted not in ISAS:
        raise ValueError(f"PDSERVE_CPU_KERNEL_ISA={wanted!r}: expected one of {', '.join(ISAS)}")
    found = []
    try:
        for isa in [wanted] if wanted else ISAS:
            if (kernel := load_build(isa)) is not None:
                found.append(kernel)
    except (OSError, RuntimeError) as exc:
        log.warning("CPU expert kernel unavailable, using the torch path: %s", exc)
        return ()
    if not found:
        need = {"avx512": "AVX-512F", "avx2": "AVX2 and FMA"}[wanted] if wanted else "AVX2 and FMA"
        log.warning("CPU expert kernel needs %s, which this CPU lacks: using the torch path", need)
    return tuple(found)


def load() -> Kernel | None:
    """The widest build this CPU runs, or None (logged once)."""
    found = kernels()
    return found[0] if found else None
