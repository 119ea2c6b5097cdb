"""Build an engine on a thread of its own that ends with the build, so that the process keeps one OpenMP thread
pool: the one of the thread that steps the engine.

libgomp gives every thread that runs a parallel region a pool of its own, kept until that thread exits. A worker
loads its model (parallel ops) on its main thread and steps it on the engine thread (AsyncEngine), so it held two
pools; once libgomp manages more threads than the process has CPUs it throttles its spinning to a few hundred
iterations, and every barrier of the engine's kernels then goes to sleep and wakes through the kernel. Measured
(benchmarks/engine_thread_pools.py, the `small` demo at 2 threads, 10 sequences, 2-core AMD EPYC, 2026-12-07): a
decode step stepped from a second thread took 15.5–16.1 ms with the engine built on the main thread and 11.7–15.4
ms built on a thread that had ended (median ratio 1.12; an earlier paired run 1.2–1.3). With one thread per
worker there is no team and nothing changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_a_passing_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """build() on a new thread, joined: its result, or what it raised. Not for code that starts processes tied to
    the calling thread (a parent-death signal fires when the thread that forked exits)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
