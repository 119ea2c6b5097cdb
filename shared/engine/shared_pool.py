"""A KV pool's memory in a memfd, so that a decode worker on the same host can read its blocks in place.

Why: a same-host hand-off through a pair's segment copies the KV twice (the prefill gathers the blocks into the
segment, the decode import copies them into its pool). With the prefill pool itself in shared memory, the decode
side copies the request's blocks straight from it into its own blocks: one copy (shared/kv/transfer/borrow.py).

Layout of the memfd: a header of `HEADER_BYTES` whose first `NONCE_BYTES` are random, then the pool tensor. A
peer opens `/proc/<pid>/fd/<fd>` read-only (the kernel lets a process of the same user do so, and nothing has a
name: the memory goes with the last mapping, even if both processes are killed) and checks the nonce, so that a
pid reused by another process (whose fd of that number is something else) is never read as our pool. The memfd
is sealed once mapped (`_seal`): whoever opens it can read it, and only the owner's mapping writes it.
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import secrets
import warnings
from dataclasses import dataclass

import numpy as np
import torch

HEADER_BYTES = 4096  # one page: the pool tensor starts page-aligned
NONCE_BYTES = 16
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1; Python names it from 3.12 on
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolHandle:
    """What a peer needs to map a pool: where its fd is, how big, what it begins with, how many blocks."""

    pid: int
    fd: int
    nbytes: int  # the whole mapping, header included
    nonce: bytes
    num_blocks: int


class SharedPoolMemory:
    """The owner's side: a memfd holding the header and a pool tensor. Its memory is zero-filled, as
    `torch.zeros` would be, and paged in on first touch."""

    def __init__(self, fd: int, mapping: mmap.mmap, nonce: bytes) -> None:
        self.fd, self._map, self.nonce = fd, mapping, nonce

    @classmethod
    def create(cls, pool_bytes: int) -> SharedPoolMemory:
        """A memfd of the header plus `pool_bytes`. OSError where memfds cannot be made (then: a private pool)."""
        fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER_BYTES + pool_bytes)
            mapping = mmap.mmap(fd, HEADER_BYTES + pool_bytes)
            nonce = secrets.token_bytes(NONCE_BYTES)
            mapping[:NONCE_BYTES] = nonce
            _seal(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mapping, nonce)

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool tensor over the memory after the header (it keeps the mapping alive)."""
        return _tensor(self._map, shape, dtype)

    def handle(self, num_blocks: int) -> PoolHandle:
        return PoolHandle(os.getpid(), self.fd, self.nbytes, self.nonce, num_blocks)


def _seal(fd: int) -> None:
    """From now on only the mapping we hold writes the pool: no write(), no writable mapping, no resize, for anyone
    who opens it (a peer of the same user can open /proc/<pid>/fd/<fd>, read-write if it asks), and no more seals.
    Linux < 5.1 has no F_SEAL_FUTURE_WRITE: the size is sealed all the same, writes are not (logged)."""
    fixed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fixed | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError as e:
        log.warning("the shared KV pool cannot be sealed against writes by its readers (%s): its size only", e)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fixed | fcntl.F_SEAL_SEAL)


def attach_pool(handle: PoolHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The peer's side: a read-only tensor of `shape` over the pool `handle` names (a write through it faults).
    OSError when the fd cannot be opened from here (another user, another pid namespace, the process gone);
    ValueError when what it opens is not that pool (size or nonce differ)."""
    expected = HEADER_BYTES + math.prod(shape) * dtype.itemsize
    if handle.nbytes != expected:
        raise ValueError(f"a pool of {handle.nbytes} bytes cannot hold {list(shape)} {dtype} after its header")
    fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != handle.nbytes:
            raise ValueError(f"fd {handle.fd} of pid {handle.pid} is not the pool announced (size differs)")
        mapping = mmap.mmap(fd, handle.nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if mapping[:NONCE_BYTES] != handle.nonce:
        mapping.close()
        raise ValueError(f"fd {handle.fd} of pid {handle.pid} is not the pool announced (nonce differs)")
    return _tensor(mapping, shape, dtype)


def _tensor(mapping: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape) * dtype.itemsize
    array = np.frombuffer(mapping, dtype=np.uint8, count=count, offset=HEADER_BYTES)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that its tensor is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(dtype).view(shape)
