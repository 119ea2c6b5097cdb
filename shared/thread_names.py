"""Names a thread as the operating system sees it (`top -H`, `ps -L`, `pidstat -t`, /proc/<pid>/task/*/comm), so
that a worker's engine thread can be told from its event loop's when their CPU is measured
(benchmarks/thread_cpu.py). Python's own thread names stay inside the interpreter (before 3.14)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15  # linux/prctl.h
MAX_NAME = 15  # bytes; the kernel keeps 16 with the terminating NUL


def name_this_thread(name: str) -> bool:
    """Set the calling thread's OS name (Linux; elsewhere nothing happens); → whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.prctl(PR_SET_NAME, name.encode()[:MAX_NAME], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
