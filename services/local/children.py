"""Child processes that do not outlive the process that started them (Linux).

`popen_options()` gives the extra `subprocess.Popen` arguments every child of pdserve's local launcher is started
with (the infra servers, the gateway, the workers):
  - its own process group: a Ctrl-C in the terminal reaches only the launcher, which then drains the children
    in order (SIGTERM, wait, SIGKILL) instead of every child getting SIGINT at once and a second signal from
    the launcher right after, which the services read as "stop now";
  - the parent-death signal (prctl PR_SET_PDEATHSIG = SIGTERM): if the launcher dies, even by SIGKILL, the
    kernel sends each child SIGTERM and it drains and exits instead of lingering as an orphan holding ports.
    Right after setting it the child checks that its parent is still the launcher: one that died between
    fork and prctl would never signal (the race), so the child exits at once instead.

The kernel ties the parent-death signal to the *thread* that forked: it fires when that thread exits. So it is
set only for children started from the main thread (whose end is the process's end); a child started from
another thread (a benchmark starting stacks from a thread pool) gets the process group but not the signal.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl


# Resolved once here, in the parent: the function that runs between fork and exec does as little as it can
# (no library loading, no imports: other threads of the parent may hold locks the child would inherit).
_PRCTL = _load_prctl()


def _die_with(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child, between fork and exec
        if _PRCTL is None or _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return  # no parent-death signal here: the launcher's own handlers remain the only stop
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def popen_options() -> dict[str, Any]:
    """Popen keyword arguments for a child that stops when this process dies (see the module docstring)."""
    options: dict[str, Any] = {"process_group": 0}
    if _PRCTL is not None and threading.current_thread() is threading.main_thread():
        options["preexec_fn"] = _die_with(os.getpid())
    return options


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), from /proc (Linux); [] when gone."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
