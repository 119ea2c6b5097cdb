"""Engines sharing a GPU set up one at a time (shared/engine/device_setup.py): the lock is exclusive across
processes, is released when its holder exits or dies, and is not taken off CUDA."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import time
import uuid

import pytest
import torch

from shared.engine import device_setup
from shared.engine.device_setup import device_lock, exclusive_setup, lock_path

pytestmark = pytest.mark.unit


def _hold(key: str, started, release, exit_hard: bool) -> None:
    with device_lock(key):
        started.set()
        release.wait(10)
        if exit_hard:
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding it: the kernel must drop the lock


def _holder(key: str, exit_hard: bool = False):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(key, started, release, exit_hard))
    proc.start()
    assert started.wait(30), "the holder did not take the lock"
    return proc, release


@pytest.mark.parametrize("exit_hard", [False, True], ids=["released", "holder-killed"])
def test_a_second_engine_waits_until_the_first_is_set_up(exit_hard):
    key = f"test-{uuid.uuid4().hex}"
    proc, release = _holder(key, exit_hard)
    try:
        fd = os.open(lock_path(key), os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held by the other process
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        t0 = time.monotonic()
        release.set()
        with device_lock(key):  # blocks until the holder leaves (or dies)
            waited = time.monotonic() - t0
        assert waited < 10
    finally:
        release.set()
        proc.join(10)
        lock_path(key).unlink(missing_ok=True)


def test_no_lock_off_cuda(monkeypatch):
    def fail(key):
        raise AssertionError("no lock is taken for a CPU engine")

    monkeypatch.setattr(device_setup, "device_lock", fail)
    with exclusive_setup(torch.device("cpu")):
        pass


def test_lock_names_a_file_per_physical_device():
    assert lock_path("cuda-GPU-1234/5").name == "pdserve-device-cuda-GPU-1234_5.lock"
    assert lock_path("cuda-a") != lock_path("cuda-b")
