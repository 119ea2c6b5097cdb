"""The CPU expert kernel (cpu_moe.c): one call per MoE layer for decode-sized batches, in three weight formats
(float32; bfloat16, a bfloat16 model's; weight-only int8 with per-output-channel scales, float32 activations)
and three builds of one source: AVX-512F + AVX512_BF16 (bfloat16 pairs through VDPBF16PS), AVX-512F (vectors of
16 floats, 12-row tiles, software prefetch) and AVX2 + FMA (8 floats, 6 rows). All give the same bits;
`kernels()` lists those this CPU runs, the widest first. The same library computes int8 dense linears
(`Kernel.linear_i8`, shared/model/int8.py).

Each is built with gcc at first use into a cache directory (PDSERVE_KERNEL_CACHE, default
~/.cache/pdserve/kernels; the file name carries the ISA and a hash of the source and flags, so an edited source
is rebuilt), loaded with ctypes. Where gcc is missing, the build fails or the CPU lacks AVX2/FMA, `kernels()` is
empty after one log line and the experts keep the torch path (shared/model/moe.py), which is also the reference
the kernel is tested against. `PDSERVE_CPU_KERNEL_ISA=avx512` (or avx2) keeps a CPU on that narrower build.

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
ISAS = {"avx512bf16": 512, "avx512": 512, "avx2": 256}  # build name → PDSERVE_ISA, the widest first
ISA_FLAGS = {"avx512bf16": ("-DPDSERVE_BF16DP",)}  # a build's flags beyond its PDSERVE_ISA
NEEDS = {"avx512bf16": "AVX-512F and AVX512_BF16", "avx512": "AVX-512F", "avx2": "AVX2 and FMA"}
# the panels' element types, by the dtype of the experts' weights (bfloat16 travels as its bits: ctypes has no
# bfloat16, the kernel reads uint16)
FORMATS = (torch.float32, torch.bfloat16)


def _build(source: Path, out_dir: Path, isa: str = "avx2", extra: tuple[str, ...] = ()) -> Path:
    """→ the shared library for `source` built for `isa` (plus `extra` compiler flags: a benchmark's variant),
    compiled unless the cache holds it (cbuild.build_library)."""
    flags = (f"-DPDSERVE_ISA={ISAS[isa]}", *ISA_FLAGS.get(isa, ()), *extra)
    return build_library(source, out_dir, flags, tag=isa)


def build() -> list[Path]:
    """Compile every build into the cache now (raises if one cannot): a Docker image does this at build time,
    so its runtime, which has no compiler, finds the libraries in `PDSERVE_KERNEL_CACHE`."""
    return [_build(SOURCE, cache_dir(), isa) for isa in ISAS]


@dataclass(frozen=True)
class ExpertPanels:
    """The experts' weights in one build's panel layout (see cpu_moe.c), L = `lanes` floats per vector.
    float32 and int8: gate_up (E, I/L, D, 2L), row k of panel j holding gate rows Lj..Lj+L then up rows Lj..Lj+L
    at column k; down (E, D/2L, I, 2L); int8 adds the columns' scales, gate_up_scale (E, I/L, 2L) and down_scale
    (E, D/2L, 2L). bfloat16: pairs of consecutive columns, gate_up (E, I/L, D/2, 2, L, 2), down
    (E, D/2L, I/2, 2L, 2)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    lanes: int
    gate_up_scale: torch.Tensor | None = None  # int8 only
    down_scale: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @classmethod
    def pack(cls, gate_up: torch.Tensor, down: torch.Tensor, lanes: int) -> ExpertPanels:
        """gate_up (E, 2I, D), down (E, D, I): the Experts module's stacked weights, float32 or bfloat16."""
        if gate_up.dtype == torch.bfloat16:
            return cls._pack_pairs(gate_up, down, lanes)
        e, two_i, d = gate_up.shape
        i = two_i // 2
        gate = gate_up[:, :i].reshape(e, i // lanes, lanes, d)
        up = gate_up[:, i:].reshape(e, i // lanes, lanes, d)
        gu = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()  # (E, I/L, D, 2L)
        dn = down.reshape(e, d // (2 * lanes), 2 * lanes, i).transpose(2, 3).contiguous()  # (E, D/2L, I, 2L)
        # the kernel loads panel rows with aligned 4L-byte loads: torch's CPU allocator aligns to 64 bytes
        assert gu.data_ptr() % (4 * lanes) == 0 and dn.data_ptr() % (4 * lanes) == 0
        return cls(gu.detach(), dn.detach(), lanes)

    @classmethod
    def _pack_pairs(cls, gate_up: torch.Tensor, down: torch.Tensor, lanes: int) -> ExpertPanels:
        """bfloat16: each float32 lane of a panel row holds one output's weights at columns 2k2 and 2k2 + 1."""
        e, two_i, d = gate_up.shape
        i = two_i // 2
        gate = gate_up[:, :i].reshape(e, i // lanes, lanes, d // 2, 2).transpose(2, 3)  # (E, I/L, D/2, L, 2)
        up = gate_up[:, i:].reshape(e, i // lanes, lanes, d // 2, 2).transpose(2, 3)
        gu = torch.stack([gate, up], dim=3).contiguous()  # (E, I/L, D/2, 2, L, 2)
        dn = down.reshape(e, d // (2 * lanes), 2 * lanes, i // 2, 2).transpose(2, 3).contiguous()
        assert gu.data_ptr() % (4 * lanes) == 0 and dn.data_ptr() % (4 * lanes) == 0
        return cls(gu.detach(), dn.detach(), lanes)

    @classmethod
    def pack_int8(
        cls, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor], lanes: int
    ) -> ExpertPanels:
        """gate_up (q (E, 2I, D) int8, scale (E, 2I) float32), down (q (E, D, I), scale (E, D)): the float32
        layout over the int8 values, and the scales of each panel's columns in the same order."""
        panels = cls.pack(gate_up[0], down[0], lanes)  # the int8 values take the float32 layout
        (_, gs), (_, ds) = gate_up, down
        e, two_i = gs.shape
        i, d = two_i // 2, ds.shape[1]
        gate, up = gs[:, :i].reshape(e, i // lanes, lanes), gs[:, i:].reshape(e, i // lanes, lanes)
        gu_scale = torch.cat([gate, up], dim=2).float().contiguous()  # (E, I/L, 2L)
        dn_scale = ds.reshape(e, d // (2 * lanes), 2 * lanes).float().contiguous()  # (E, D/2L, 2L)
        return cls(panels.gate_up, panels.down, lanes, gu_scale, dn_scale)


@dataclass(frozen=True)
class Kernel:
    """One loaded build of cpu_moe.c."""

    lib: ctypes.CDLL
    isa: str  # a key of ISAS
    lanes: int  # floats per vector: L of the panel layout

    def supports(self, hidden: int, intermediate: int, dtype: torch.dtype) -> str | None:
        """None when this build can compute experts of these sizes and weight dtype (float32 or bfloat16; int8
        experts hold float32 weights, their dequantized values), else why not."""
        if dtype not in FORMATS:
            return f"dtype {dtype} (the kernel takes float32, bfloat16 and int8 weights)"
        if hidden % (2 * self.lanes) or intermediate % self.lanes:
            return (f"hidden {hidden} not a multiple of {2 * self.lanes} or intermediate {intermediate} of "
                    f"{self.lanes} ({self.isa})")  # fmt: skip
        return None

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertPanels:
        return ExpertPanels.pack(gate_up, down, self.lanes)

    def pack_int8(
        self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]
    ) -> ExpertPanels:
        return ExpertPanels.pack_int8(gate_up, down, self.lanes)

    def moe(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        panels: ExpertPanels,
        threads: int | None = None,
        load: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, D), topk_ids (T, A) int64, topk_weights (T, A) → (T, D): sum over a of
        topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t]), SiLU-gated experts, on `threads` threads (None =
        torch.get_num_threads(), the engine's intra-op count). The result is bitwise the same for any count.
        x is float32 for float32 and int8 panels, bfloat16 for bfloat16 ones (the result in x's dtype); with
        bfloat16, weights given in bfloat16 round each weighted expert output to bfloat16 (torch's product).
        load: None, or an (E,) int64 contiguous CPU counter the kernel adds each expert's routed rows to (the
        bincount of topk_ids, MoE.expert_load's update, without two torch ops a layer)."""
        assert topk_ids.dtype == torch.int64 and panels.lanes == self.lanes
        x = x.contiguous()
        ids = topk_ids.contiguous()
        weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
        weights = weights.contiguous()
        t, d = x.shape
        e = panels.gate_up.shape[0]
        i = panels.down.shape[2] * (2 if panels.dtype == torch.bfloat16 else 1)
        threads = torch.get_num_threads() if threads is None else threads
        out = torch.empty_like(x)
        if load is not None and not (load.dtype == torch.int64 and load.shape == (e,) and load.is_contiguous()):
            raise ValueError(f"load must be a contiguous ({e},) int64 counter")
        counter = None if load is None else load.data_ptr()
        head = (x.data_ptr(), t, d, i, e, ids.shape[1], ids.data_ptr(), weights.data_ptr())
        if panels.dtype == torch.float32:
            assert x.dtype == torch.float32
            rc = self.lib.pdserve_moe_f32(
                *head, panels.gate_up.data_ptr(), panels.down.data_ptr(), out.data_ptr(), threads, counter
            )
        elif panels.dtype == torch.bfloat16:
            assert x.dtype == torch.bfloat16
            rc = self.lib.pdserve_moe_bf16(
                *head, panels.gate_up.data_ptr(), panels.down.data_ptr(), out.data_ptr(), threads,
                int(topk_weights.dtype == torch.bfloat16), counter,
            )  # fmt: skip
        else:
            assert x.dtype == torch.float32 and panels.gate_up_scale is not None and panels.down_scale is not None
            rc = self.lib.pdserve_moe_i8(
                *head, panels.gate_up.data_ptr(), panels.gate_up_scale.data_ptr(), panels.down.data_ptr(),
                panels.down_scale.data_ptr(), out.data_ptr(), threads, counter,
            )  # fmt: skip
        if rc != 0:
            raise MemoryError("CPU expert kernel: scratch allocation failed")
        return out

    def linear_f32(self, x: torch.Tensor, panels: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x (M, K) float32 @ the float32 weight of `panels` (N/2L, K, 2L) → (M, N): shared/model/panel_linear.py's
        dense linears."""
        assert x.dtype == torch.float32 and panels.dtype == torch.float32
        x = x.contiguous()
        m, k = x.shape
        n = panels.shape[0] * panels.shape[2]
        out = torch.empty(m, n, dtype=torch.float32)
        self.lib.pdserve_linear_f32(
            x.data_ptr(), m, k, n, panels.data_ptr(), out.data_ptr(),
            torch.get_num_threads() if threads is None else threads,
        )  # fmt: skip
        return out

    def linear_i8(self, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, threads: int | None = None):
        """x (M, K) float32 @ the int8 weight of `panels` (N/2L, K, 2L) with `scale` (N/2L, 2L) → (M, N):
        shared/model/int8.py's dense linears."""
        assert x.dtype == torch.float32 and panels.dtype == torch.int8
        x = x.contiguous()
        m, k = x.shape
        n = panels.shape[0] * panels.shape[2]
        out = torch.empty(m, n, dtype=torch.float32)
        self.lib.pdserve_linear_i8(
            x.data_ptr(), m, k, n, panels.data_ptr(), scale.data_ptr(), out.data_ptr(),
            torch.get_num_threads() if threads is None else threads,
        )  # fmt: skip
        return out


def load_build(isa: str, extra: tuple[str, ...] = ()) -> Kernel | None:
    """Build `isa` (with `extra` flags) and load it; None where this CPU cannot run it. Raises RuntimeError or
    OSError where it cannot be built or loaded."""
    lib = ctypes.CDLL(str(_build(SOURCE, cache_dir(), isa, extra)))
    if not lib.pdserve_cpu_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    head = [ptr, i64, i64, i64, i64, i64, ptr, ptr]  # x, T, D, I, E, A, ids, weights
    lib.pdserve_moe_f32.argtypes = [*head, ptr, ptr, ptr, ctypes.c_int, ptr]  # ..., threads, load counter
    lib.pdserve_moe_bf16.argtypes = [*head, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr]
    lib.pdserve_moe_i8.argtypes = [*head, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr]
    lib.pdserve_linear_i8.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.pdserve_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
    linears = (lib.pdserve_linear_i8, lib.pdserve_linear_f32)
    for entry in (lib.pdserve_moe_f32, lib.pdserve_moe_bf16, lib.pdserve_moe_i8, *linears):
        entry.restype = ctypes.c_int
    return Kernel(lib, isa, lib.pdserve_lanes())


@functools.cache
def kernels() -> tuple[Kernel, ...]:
    """The builds this CPU runs, the widest first (only `PDSERVE_CPU_KERNEL_ISA`'s when that is set); empty,
    logged once, where none can be built or run."""
    wanted = os.environ.get("PDSERVE_CPU_KERNEL_ISA") or None
    if wanted is not None and wanted not in ISAS:
        raise ValueError(f"PDSERVE_CPU_KERNEL_ISA={wanted!r}: expected one of {', '.join(ISAS)}")
    found = []
    for isa in [wanted] if wanted else ISAS:
        try:
            kernel = load_build(isa)
        except (OSError, RuntimeError) as exc:
            if isa in ISA_FLAGS and not wanted:  # e.g. a gcc without AVX512_BF16: the plain builds remain
                log.info("CPU expert kernel: no %s build (%s)", isa, str(exc)[:200])
                continue
            log.warning("CPU expert kernel unavailable, using the torch path: %s", exc)
            return ()
        if kernel is not None:
            found.append(kernel)
    if not found:
        need = NEEDS[wanted or "avx2"]
        log.warning("CPU expert kernel needs %s, which this CPU lacks: using the torch path", need)
    return tuple(found)


def load() -> Kernel | None:
    """The widest build this CPU runs, or None (logged once)."""
    found = kernels()
    return found[0] if found else None
