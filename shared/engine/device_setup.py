"""Engines that share one GPU size their KV pools one at a time.

An engine on CUDA counts as its own the memory outside torch's allocator that appears between its first look
at the device and its KV plan (shared/engine/kv_measure.py). If a second engine on the same GPU loaded its
weights in that window, the first would count them as its own and shrink its pool (or refuse to start). So
from that first look until its pool is allocated an engine holds an advisory lock named after the physical
device (its UUID: CUDA_VISIBLE_DEVICES can give one GPU different indices in different processes). The lock is
an flock on a file in the temporary directory: it covers the processes of one machine (or one container),
which is where GPUs are shared, and the kernel drops it if the process dies.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def lock_path(device_key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device_key)
    return Path(tempfile.gettempdir()) / f"pdserve-device-{safe}.lock"


@contextmanager
def exclusive_setup(device: torch.device) -> Iterator[None]:
    """Hold the device's setup lock (CUDA only; any other device: no lock). Blocks while another engine on
    the same GPU is between its first look at the device and its pool allocation."""
    if device.type != "cuda":
        yield
        return
    with device_lock(_device_key(device)):
        yield


@contextmanager
def device_lock(device_key: str) -> Iterator[None]:
    """The advisory lock for `device_key`, logging when it had to wait."""
    path = lock_path(device_key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another engine is setting up on %s; waiting for it (%s)", device_key, path)
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("waited %.1f s for the device setup lock", time.monotonic() - started)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _device_key(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda-{uuid}" if uuid is not None else f"cuda-{index}"
