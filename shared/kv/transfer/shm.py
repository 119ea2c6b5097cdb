"""The same-host path: a shared-memory segment per (prefill, decode) pair, mapped by both sides.

Host identity (`host_identity`): the kernel's boot id, the hostname and the device of /dev/shm. Two
processes that report the same identity run under one kernel and see the same /dev/shm, so a file created
there by one can be mapped by the other. The decode side sends its identity in Connect; the server offers a
segment when it equals its own.

Lifetime, so that nothing stays in /dev/shm whatever happens to either worker:
1. the prefill worker creates `/dev/shm/pdserve-kv-<its pid>-<random>` (mode 0600, O_EXCL), reserves its
   memory (`posix_fallocate`: a full /dev/shm fails here, cleanly, instead of SIGBUS on first touch), maps it
   and names it in the Connect reply;
2. the decode worker maps it and unlinks it at once; the prefill worker unlinks it too when the pair has
   formed or failed (whichever comes first). From then on the segment has no name: the memory lives as long
   as a mapping does, and goes with the last one, even if both processes are killed;
3. a prefill worker that is killed between 1 and 2 leaves the file behind: every server, when it starts,
   removes `pdserve-kv-<pid>-*` files whose pid is not a live process (`sweep_stale`).

Regions: the decode side owns the allocation (`Regions`). For each pull it reserves the largest free extent,
offers it in the Pull; the server writes the KV there if it fits and says how many bytes it wrote. The
received tensor is a view of the segment (no copy on the decode side); its region is free again when the
tensor and every view of it are gone (a finalizer on the array under it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import socket
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[A-Za-z0-9_-]+$")
ALIGN = 64  # region offsets: a cache line, and a multiple of every dtype's size


def host_identity() -> str:
    """Same string on two processes ⇔ same kernel boot, hostname and /dev/shm: a segment one creates, the
    other can map. Empty when /dev/shm is not there (no same-host path)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        shm_dev = SHM_DIR.stat().st_dev
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}/{shm_dev}"


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments of processes that no longer run (killed before they could unlink); their names."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            match = _NAME.match(entry.name)
            if match is None or _alive(int(match.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, and not ours to judge
        return True
    return True


class Segment:
    """One mapping of a pair's segment. `create` (prefill side) or `attach` (decode side)."""

    def __init__(self, name: str, nbytes: int, mapping: mmap.mmap, path: Path) -> None:
        self.name = name
        self.nbytes = nbytes
        self._map = mapping
        self._path = path

    @classmethod
    def create(cls, nbytes: int, directory: Path = SHM_DIR) -> Segment:
        """A new segment of `nbytes`, memory reserved. OSError (e.g. ENOSPC) leaves no file behind."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_urlsafe(12)}"
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(name, nbytes, mapping, path)

    @classmethod
    def attach(cls, name: str, nbytes: int, directory: Path = SHM_DIR) -> Segment:
        """Map the segment the server named, then unlink it (we are the last to map it). ValueError for a name
        that is not a segment's or a size that differs."""
        if _NAME.match(name) is None:
            raise ValueError(f"{name!r} is not a KV segment name")
        path = directory / name
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise ValueError(f"segment {name} has {os.fstat(fd).st_size} bytes, not the {nbytes} announced")
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        return cls(name, nbytes, mapping, path)

    def close(self) -> None:
        """Unmap now if no tensor is on the segment any more; else the mapping goes with the last one."""
        with contextlib.suppress(BufferError):
            self._map.close()

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid). Idempotent."""
        self._path.unlink(missing_ok=True)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, on_free=None) -> torch.Tensor:
        """A tensor over [offset, offset + its bytes) of the segment. `on_free()` runs once the tensor and
        every view of it are gone."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} do not fit a segment of {self.nbytes}")
        array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)
        if on_free is not None:
            weakref.finalize(array, on_free)  # the tensor below keeps the array alive, and nothing else does
        return torch.from_numpy(array).view(dtype).view(shape)


class Regions:
    """The decode side's allocation of its segment: reserve the largest free extent for a pull, keep what the
    pull used, free a region when its tensor dies. Thread-safe (finalizers run on any thread)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: dict[int, int] = {0: nbytes}  # offset → length, disjoint, not merged with neighbours yet
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free.values())

    def reserve(self) -> tuple[int, int]:
        """(offset, capacity) of the largest free extent, now taken; (0, 0) when none is free."""
        with self._lock:
            self._merge()
            if not self._free:
                return 0, 0
            offset = max(self._free, key=self._free.__getitem__)
            return offset, self._free.pop(offset)

    def keep(self, offset: int, capacity: int, used: int) -> None:
        """The pull at `offset` used `used` of its `capacity` bytes: the rest is free again."""
        kept = min(capacity, -(-used // ALIGN) * ALIGN)
        if kept < capacity:
            self.free(offset + kept, capacity - kept)

    def free(self, offset: int, length: int) -> None:
        with self._lock:
            self._free[offset] = length

    def _merge(self) -> None:
        merged: dict[int, int] = {}
        last = None
        for offset in sorted(self._free):
            if last is not None and last + merged[last] == offset:
                merged[last] += self._free[offset]
            else:
                merged[offset] = self._free[offset]
                last = offset
        self._free = merged
