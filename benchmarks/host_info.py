"""What a CPU benchmark figure depends on, recorded with it: the CPU (model, vendor, GEMM-relevant flags,
cores), the threads used, the BLAS torch calls, the memory read bandwidth and a large matmul's FLOP rate.

The same model weights run at very different speeds on hosts of different vendors: the default CPU GEMM
(MKL) has a fast small-matrix path on Intel and a slow one on AMD, which oneDNN's prepacked weights avoid.
Two runs can only be compared when the JSON says which host each came from.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

# flags that decide which GEMM kernels MKL and oneDNN can use
GEMM_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_info() -> dict:
    """Model name, vendor, GEMM flags present, logical CPUs online and CPUs this process may run on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's entry
    flags = set(fields.get("flags", "").split())
    return dict(
        cpu=fields.get("model name") or platform.processor() or "unknown",
        cpu_vendor=fields.get("vendor_id", "unknown"),
        cpu_flags=[f for f in GEMM_FLAGS if f in flags],
        cpu_count=os.cpu_count(),
        cpu_affinity=len(os.sched_getaffinity(0)),
        threads=torch.get_num_threads(),
        mkl=torch.backends.mkl.is_available(),
        mkldnn=torch.backends.mkldnn.is_available(),
    )


def read_bandwidth(mib: int = 256, repeats: int = 15) -> float:
    """GB/s of streaming a large tensor from memory once (a sum): the rate a decode step reads weights at."""
    src = torch.ones(mib << 18)  # float32, touched now so page faults stay out of the timing
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(times[1:]) / 1e9


def matmul_gflops(repeats: int = 7) -> float:
    """A large square matmul: roughly the best FLOP rate these threads reach."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / statistics.median(times[1:]) / 1e9


def load_average() -> tuple[float, float, float]:
    """1, 5 and 15 minute load averages (what `uptime` prints): how busy a shared machine was."""
    return os.getloadavg()


def describe(info: dict) -> str:
    """One line for a report header."""
    return (
        f"{info['cpu']} ({info['cpu_vendor']}; {' '.join(info['cpu_flags']) or 'no AVX2'}), "
        f"{info['cpu_affinity']}/{info['cpu_count']} CPUs, {info['threads']} threads"
    )
