"""What every check shares: the device plan (`Target`), the result type, timing, and running one check in a
child process under a timeout."""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing as mp
import os
import signal
import statistics
import time
import traceback
from collections.abc import Callable
from enum import StrEnum
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch


class Outcome(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"  # could not run here (said why in details); does not fail the run


@dataclasses.dataclass
class CheckResult:
    name: str
    outcome: Outcome
    numbers: dict[str, Any] = dataclasses.field(default_factory=dict)
    details: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome is not Outcome.FAIL

    def to_json(self) -> dict[str, Any]:
        return dict(name=self.name, ok=self.ok, outcome=self.outcome.value, wall_s=round(self.wall_s, 2),
                    numbers=self.numbers, details=self.details)  # fmt: skip


def verdict(name: str, failures: list[str], numbers: dict[str, Any], details: str) -> CheckResult:
    """PASS when `failures` is empty; else FAIL with the failures first in the details."""
    if failures:
        return CheckResult(name, Outcome.FAIL, numbers, "; ".join(failures) + (f" ({details})" if details else ""))
    return CheckResult(name, Outcome.PASS, numbers, details)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the checks run. cpu: the --allow-cpu rehearsal (gloo, Triton interpreted, tiny shapes, fewer
    steps); else the CUDA devices. work_dir holds the demo checkpoints the checks write."""

    cpu: bool
    num_gpus: int
    work_dir: str

    def device(self, index: int = 0) -> str:
        """The index-th device, wrapping around when there are fewer GPUs (one GPU serves every role)."""
        return "cpu" if self.cpu else f"cuda:{index % self.num_gpus}"

    @property
    def two_gpus(self) -> bool:
        return self.num_gpus >= 2


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() in milliseconds, the device synchronised around every call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---- one check in a child process ---------------------------------------------------------------------------


def run_isolated(name: str, module: str, target: Target, timeout_s: float) -> CheckResult:
    """`module`.check(target) in a spawned child (its own process group, so a timeout kills what it started too);
    a timeout, an exception or a dead child is a FAIL that says which. Sets wall_s."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, module, target, theirs), name=f"gpu-check-{name}")
    started = time.perf_counter()
    proc.start()
    theirs.close()
    try:
        if ours.poll(timeout_s):
            result = ours.recv()
        elif proc.is_alive():
            result = CheckResult(name, Outcome.FAIL, details=f"timed out after {timeout_s:.0f} s")
        else:
            result = CheckResult(name, Outcome.FAIL, details=f"the check's process died (exit code {proc.exitcode})")
    except EOFError:
        proc.join(5)
        result = CheckResult(name, Outcome.FAIL, details=f"the check's process died (exit code {proc.exitcode})")
    finally:
        _kill_group(proc)
    result.wall_s = time.perf_counter() - started
    return result


def _child(name: str, module: str, target: Target, conn: Connection) -> None:
    os.setpgrp()  # the parent kills this group on timeout: whatever this check started goes with it
    try:
        result = importlib.import_module(module).check(target)
    except BaseException:  # reported, not raised: the parent turns it into this check's FAIL
        result = CheckResult(name, Outcome.FAIL, details=traceback.format_exc(limit=8)[-3000:])
    conn.send(result)
    conn.close()


def _kill_group(proc: BaseProcess) -> None:
    proc.join(10)
    if proc.pid is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the check (its own children), or a hung check
        except (ProcessLookupError, PermissionError):
            pass
    proc.join(5)
