"""Start the other ranks of a worker group: rank 0 is the calling process, ranks 1..R-1 are children
(multiprocessing "spawn": a fresh interpreter, no inherited threads or CUDA state) that join the group and
run `target(group, *args)`. The children die with the parent (parent-death signal on Linux)."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from shared.ports import free_port
from shared.sharding.group import RankGroup, Rendezvous


def _child(rdv: Rendezvous, rank: int, target: Callable[..., Any], args: tuple, parent: int) -> None:
    _die_with_parent()
    # The signal only covers deaths from now on: a leader that died while this interpreter was still starting
    # (importing torch takes seconds) left it orphaned already, re-parented away from `parent`.
    if os.getppid() != parent:
        os._exit(1)
    group = RankGroup.join(rdv, rank, local_host=rdv.host)
    target(group, *args)


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the leader's watch still ends the group
        pass


def spawn_followers(rdv: Rendezvous, target: Callable[..., Any], args: tuple = ()) -> list[BaseProcess]:
    """Start ranks 1..world-1 running `target(group, *args)`; the caller then joins as rank 0
    (`RankGroup.join(rdv, 0)`). `target` and `args` must be picklable (module-level)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, rdv.world):
        p = ctx.Process(target=_child, args=(rdv, rank, target, args, os.getpid()), name=f"rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def local_rendezvous(
    world: int, backend: str = "gloo", timeout_s: float = 30.0, start_timeout_s: float | None = None
) -> Rendezvous:
    """A rendezvous on a free loopback port (one machine: tests, `pdserve generate`, local workers)."""
    return Rendezvous("127.0.0.1", free_port(), world, backend, timeout_s, start_timeout_s=start_timeout_s)


def run_on_ranks(world: int, target: Callable[..., Any], args: tuple = (), timeout_s: float = 120.0) -> list[Any]:
    """Run `target(group, *args)` on every rank of a fresh local group of `world` (this process is rank 0,
    the others spawned) and return each rank's result, in rank order (SPMD: tests, benchmarks). A rank that
    raises makes this raise RuntimeError with that rank's error. `target`, `args` and the results must be
    picklable; `timeout_s` bounds every collective (model loading included)."""
    rdv = local_rendezvous(world, timeout_s=timeout_s)
    procs = spawn_followers(rdv, _run_and_report, (target, args))
    group = RankGroup.join(rdv, 0)
    try:
        results = _gather_results(group, _outcome(target, group, args))
    finally:
        group.close()
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
    for rank, (ok, value) in enumerate(results):
        if not ok:
            raise RuntimeError(f"rank {rank} of {world} failed: {value}")
    return [value for _, value in results]


def _run_and_report(group: RankGroup, target: Callable[..., Any], args: tuple) -> None:
    _gather_results(group, _outcome(target, group, args))


def _outcome(target: Callable[..., Any], group: RankGroup, args: tuple) -> tuple[bool, Any]:
    try:
        return True, target(group, *args)
    except Exception as e:  # reported to rank 0, which raises it: a test sees which rank failed and why
        import traceback

        return False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _gather_results(group: RankGroup, mine: tuple[bool, Any]) -> list[tuple[bool, Any]]:
    """Every rank's (ok, value), in rank order, on every rank (one broadcast per rank)."""
    return [group.broadcast_object(mine if r == group.rank else None, src=r) for r in range(group.world)]
