"""Compile a C kernel of this package with gcc into the kernel cache, once per source and flags.

The cache is PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/kernels); a library's file name carries a hash of
its source and flags, so an edited source is rebuilt. A Docker image builds its kernels at image build time
(`build` of each kernel module), since its runtime has no compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# -fopenmp links libgomp.so.1: torch's CPU build loads its own libgomp under that soname first, so a kernel's
# parallel regions run on torch's OpenMP pool (one pool, no second set of spinning threads). No -march: the
# kernels pick their instruction set at run time (target attributes). -ffp-contract=off: no fused multiply-add
# the source did not ask for, so the bits do not depend on the compiler's mood.
CFLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def build_library(source: Path, out_dir: Path | None = None, flags: tuple[str, ...] = (), tag: str = "") -> Path:
    """→ the shared library for `source` built with CFLAGS + `flags` (`tag` names the build in the file name,
    e.g. its ISA), compiled unless the cache holds it (raises RuntimeError when it cannot be; atomic rename:
    concurrent builders of the same source race harmlessly)."""
    out_dir = cache_dir() if out_dir is None else out_dir
    flags = (*CFLAGS, *flags)
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}{'-' + tag if tag else ''}-{digest}.so"
    if target.exists():
        return target
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    if gcc is None:
        raise RuntimeError("no C compiler (gcc, or $CC) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([gcc, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{gcc} failed: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, log: logging.Logger, what: str, fallback: str) -> ctypes.CDLL | None:
    """The library of `source` (built into the cache if needed), or None after one warning naming `what` and
    the `fallback` that runs instead, where it cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build_library(source, cache_dir())))
    except (OSError, RuntimeError) as exc:
        log.warning("%s unavailable, using %s: %s", what, fallback, exc)
        return None
