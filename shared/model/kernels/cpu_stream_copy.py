"""A gather of byte ranges into a contiguous tensor with streaming stores (cpu_stream_copy.c says why): the
same-host KV send's copy into the shared segment.

Built with gcc at first use into the kernel cache (cbuild.py), loaded with ctypes. Where gcc is missing or the
build fails, `load()` returns None after one log line and the caller copies with torch, which is also the
reference the kernel is tested against.

The same-host send streams only copies of `min_bytes()` or more: 3/4 of the last-level cache, glibc's rule for its
own memcpy's non-temporal stores. A smaller copy with plain stores leaves its bytes in the cache the reading
process shares (the decode side imports them next), and its source is likely cached too; a larger one would
evict the whole cache anyway, so it may as well not pass through it. benchmarks/stream_copy_bench.py on a
2-core AMD EPYC (32 MiB L3; docs/benchmarks.md), the gather plus a read of what it wrote: 8.4 MB 0.59 ms
streamed, 0.30 ms plain; 33.6 MB even; 67 MB 6.4 against 6.8 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from pathlib import Path

import torch

from shared.model.kernels.cbuild import build_library, cache_dir, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
DEFAULT_MIN_BYTES = 8 << 20  # where sysfs does not say: three quarters of a modest 10-11 MiB L3
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@functools.cache
def min_bytes(caches: Path = CPU_CACHES) -> int:
    """Bytes from which a copy streams: 3/4 of the largest cache level sysfs lists for cpu0 (`size` such as
    "32768K"), DEFAULT_MIN_BYTES where it lists none."""
    largest = 0
    with contextlib.suppress(OSError):
        for index in caches.glob("index*"):
            with contextlib.suppress(OSError, ValueError):  # unreadable, empty or not a size: skipped
                size = (index / "size").read_text().strip()
                unit = _UNITS.get(size[-1:], 1)
                largest = max(largest, int(size[:-1] if unit > 1 else size) * unit)
    return largest * 3 // 4 if largest else DEFAULT_MIN_BYTES


def build() -> Path:
    """Compile the kernel into the cache now (raises if it cannot): a Docker image does this at build time."""
    return build_library(SOURCE, cache_dir())


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) where it cannot be built."""
    lib = load_library(SOURCE, log, "CPU streaming copy", "torch's copy")
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    lib.pdserve_gather_stream.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int64, ctypes.c_int]
    lib.pdserve_gather_stream.restype = None
    return lib


def gather(
    lib: ctypes.CDLL, out: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
) -> None:
    """Pieces of `src`'s memory into `out`, back to back: piece i is `lengths[i]` bytes starting `offsets[i]`
    bytes into src's storage (int64 tensors). `out` contiguous, on the CPU, exactly the pieces' total; every
    piece inside src's memory (checked: the C side trusts them)."""
    if out.device.type != "cpu" or src.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("a streaming gather needs a contiguous host `out` and a host `src`")
    offsets, lengths = offsets.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    if offsets.shape != lengths.shape or offsets.dim() != 1:
        raise ValueError(f"offsets {tuple(offsets.shape)} and lengths {tuple(lengths.shape)} differ")
    src_bytes = src.untyped_storage().nbytes() - src.storage_offset() * src.element_size()
    if len(offsets) and (
        int(offsets.min()) < 0 or int(lengths.min()) < 0 or int((offsets + lengths).max()) > src_bytes
    ):
        raise ValueError("a piece lies outside the source's memory")
    total = int(lengths.sum())
    if total != out.numel() * out.element_size():
        raise ValueError(f"the pieces hold {total} bytes, `out` {out.numel() * out.element_size()}")
    starts = torch.empty(len(offsets) + 1, dtype=torch.int64)
    lib.pdserve_gather_stream(
        out.data_ptr(),
        src.data_ptr(),
        offsets.data_ptr(),
        lengths.data_ptr(),
        starts.data_ptr(),
        len(offsets),
        torch.get_num_threads(),
    )
