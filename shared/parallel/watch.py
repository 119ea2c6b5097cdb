"""The leader watches its followers: one that exits (crash, kill, OOM) takes the whole group down at once.

A thread waits on the followers' process sentinels; when one fires it logs which rank died and calls
`on_death` — by default the leader process exits non-zero at once (`os._exit`), so that the group is one dead
worker to the rest of the system: its heartbeats stop, the gateway's watchdog moves its requests, and
`pdserve up`'s supervisor restarts it. A follower that hangs instead is caught by the leader's next collective
timing out (group.py). `disarm()` before a planned stop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

EXIT_RANK_DIED = 3  # the leader's exit status when one of its followers died


def exit_now(rank: int, exitcode: int | None) -> None:
    """The default reaction: flush what was logged and leave without running anything else (the engine thread
    may be blocked in a collective with the dead rank)."""
    del rank, exitcode
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(EXIT_RANK_DIED)


class FollowerWatch:
    def __init__(self, procs: list[BaseProcess], on_death: Callable[[int, int | None], None] = exit_now) -> None:
        self._procs = {p.sentinel: (rank, p) for rank, p in enumerate(procs, start=1)}
        self._on_death = on_death
        self._armed = threading.Event()
        self._armed.set()
        self._wake_r, self._wake_w = os.pipe()  # disarm() wakes the thread
        self._thread = threading.Thread(target=self._run, name="follower-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ready = wait([*self._procs, self._wake_r])
        if not self._armed.is_set():
            return
        for sentinel in ready:
            if isinstance(sentinel, int) and sentinel in self._procs:
                rank, proc = self._procs[sentinel]
                proc.join(1)  # the sentinel fired: its status is a moment away
                log.critical(
                    "rank %d of the worker group (pid %s) exited with status %s: the group stops",
                    rank,
                    proc.pid,
                    proc.exitcode,
                )
                self._on_death(rank, proc.exitcode)
                return

    def disarm(self) -> None:
        """A planned stop: the followers' exits are expected from now on."""
        self._armed.clear()
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)
