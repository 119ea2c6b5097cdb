"""Start the other ranks of a worker group: rank 0 is the calling process, ranks 1..R-1 are children
(multiprocessing "spawn": a fresh interpreter, no inherited threads or CUDA state) that join the group and
run `target(group, *args)`. The children die with the parent (parent-death signal on Linux)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any

from shared.parallel.group import RankGroup, Rendezvous


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child(rdv: Rendezvous, rank: int, target: Callable[..., Any], args: tuple) -> None:
    _die_with_parent()
    group = RankGroup.join(rdv, rank, local_host=rdv.host)
    target(group, *args)


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the leader's watch still ends the group
        pass


def spawn_followers(rdv: Rendezvous, target: Callable[..., Any], args: tuple = ()) -> list[mp.process.BaseProcess]:
    """Start ranks 1..world-1 running `target(group, *args)`; the caller then joins as rank 0
    (`RankGroup.join(rdv, 0)`). `target` and `args` must be picklable (module-level)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, rdv.world):
        p = ctx.Process(target=_child, args=(rdv, rank, target, args), name=f"rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def local_rendezvous(
    world: int, backend: str = "gloo", timeout_s: float = 30.0, start_timeout_s: float | None = None
) -> Rendezvous:
    """A rendezvous on a free loopback port (one machine: tests, `pdserve generate`, local workers)."""
    return Rendezvous("127.0.0.1", free_port(), world, backend, timeout_s, start_timeout_s=start_timeout_s)
