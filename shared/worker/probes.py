"""A worker's health and readiness, for orchestrators (Kubernetes probes: deploy/k8s/), served beside /metrics on
the worker's metrics port (shared/telemetry/metrics.py):

    /health  200 while the worker is alive: its engine has not failed and its heartbeat task ran within
             HEALTH_STALE_S. The task builds a beat every HEARTBEAT_S whether or not NATS takes it, so a NATS outage
             is no reason to restart a worker; an event loop that stopped turning is.
    /ready   200 while it takes jobs: connected and serving (engine started, its tasks running), NATS connected,
             not draining. A Deployment's rolling update waits for it before it drains an old worker.

Each answers (ok, why). The metrics server calls them from its own thread: they only read what the event loop sets.
"""

from __future__ import annotations

import time
from typing import Protocol

from shared.telemetry.metrics import Probe

HEALTH_STALE_S = 30.0  # no heartbeat task run for this long: the event loop is stuck


class Probed(Protocol):
    """What the probes read of a worker (shared/worker/runtime.py: Worker)."""

    @property
    def serving(self) -> bool: ...  # connected, engine started, its tasks running (until it stops)

    @property
    def draining(self) -> bool: ...

    @property
    def failure(self) -> BaseException | None: ...  # why the engine thread died

    @property
    def last_beat(self) -> float | None: ...  # time.monotonic() of the last heartbeat built

    def nats_connected(self) -> bool: ...


class WorkerProbes:
    def __init__(self, worker: Probed, stale_s: float = HEALTH_STALE_S) -> None:
        self.worker = worker
        self.stale_s = stale_s

    def health(self) -> tuple[bool, str]:
        w = self.worker
        if w.failure is not None:
            return False, f"the engine failed: {w.failure!r}"
        if w.last_beat is not None and (quiet := time.monotonic() - w.last_beat) > self.stale_s:
            return False, f"no heartbeat for {quiet:.0f} s: the event loop is stuck"
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        w = self.worker
        if w.draining:
            return False, "draining: taking no new jobs"
        if not w.serving:
            return False, "starting"
        if not w.nats_connected():
            return False, "NATS connection lost; reconnecting"
        return True, "taking jobs"

    def routes(self) -> dict[str, Probe]:
        """The paths the metrics server answers with them."""
        return {"/health": self.health, "/ready": self.ready}
