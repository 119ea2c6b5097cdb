"""The gateway's graceful shutdown: on SIGTERM (or Ctrl-C) it drains before uvicorn stops listening.

While draining, /ready answers 503 "draining" (a load balancer takes the gateway out of rotation), a new
completion gets 503 saying the gateway is shutting down, and the requests in flight, streaming or not, run to
their end. The gateway keeps listening meanwhile, so a client that still reaches it hears why instead of
"connection refused". Then uvicorn's own shutdown runs: it closes the listener, waits for the connections,
and runs the lifespan shutdown (the NATS backend closes).

Timeline after the signal, T = drain_timeout_s:
    [0, T - reserve)   wait until no HTTP request is in flight (uvicorn's count of request tasks)
    T - reserve        still some: the expiry hooks run (the app's backend ends every open request with a
                       clear 503 error: an SSE error event and [DONE], or a JSON error)
    then               uvicorn's shutdown, its connection wait bounded by what is left of T
A second Ctrl-C exits at once (uvicorn's force exit). A drained gateway exits with status 0: uvicorn's
re-raising of the captured signal after shutdown (which would end the process "killed by SIGTERM") is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from shared.telemetry.lifecycle import exit_by

log = logging.getLogger(__name__)


class Drain:
    """Whether the gateway is draining, since when, and until when. `begin` may be called from a signal
    handler (it only records the time)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("drain_timeout_s must be positive")
        self.timeout_s = timeout_s
        # kept for ending the stragglers cleanly and for uvicorn's shutdown, out of the whole timeout: a quarter,
        # at least 2 s (writing the last error events of every open stream took over 1 s on a loaded 2-core host,
        # and uvicorn cut them mid-body), at most 10 s, and never more than half the timeout
        self.reserve_s = min(10.0, max(2.0, timeout_s / 4), timeout_s / 2)
        self.started_at: float | None = None
        self._expiry_hooks: list[Callable[[], Awaitable[None]]] = []

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self, now: float) -> bool:
        """Start draining; False when it already had."""
        if self.started_at is not None:
            return False
        self.started_at = now
        return True

    def expired(self, now: float) -> bool:
        """In-flight requests had their time: past T - reserve."""
        return self.started_at is not None and now >= self.started_at + self.timeout_s - self.reserve_s

    def left_s(self, now: float) -> float:
        """Seconds until the whole drain timeout is spent."""
        return self.timeout_s if self.started_at is None else max(0.0, self.started_at + self.timeout_s - now)

    def on_expiry(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` if requests are still in flight at the expiry (each bounded by half the reserve)."""
        self._expiry_hooks.append(hook)

    async def expire(self) -> None:
        for hook in self._expiry_hooks:
            try:
                await asyncio.wait_for(hook(), self.reserve_s / 2)
            except Exception as exc:  # ending stragglers is best effort: the shutdown goes on regardless
                log.warning("drain expiry hook failed: %s: %s", type(exc).__name__, exc)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT starts a drain instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain, exit_deadline_s: float | None = None) -> None:
        """`exit_deadline_s`: once a drain begins, the process ends itself if still running this long after
        (shared/telemetry/lifecycle.py exit_by); None in a process that is not the gateway's own."""
        super().__init__(config)
        self.drain = drain
        self.exit_deadline_s = exit_deadline_s
        self._last_report = -1.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not uvicorn's: that one also records the signal, to re-raise it once the server has stopped.
        # Nothing is logged here (a signal handler interrupts arbitrary code): the next tick reports it.
        if self.drain.begin(time.monotonic()):
            return
        if sig == signal.SIGINT:  # a second Ctrl-C: stop now
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and self.exit_deadline_s is not None:  # here, not in the handler: it starts a thread
            exit_by(self.exit_deadline_s)
        if self.drain.draining and not self.should_exit:
            await self._drain_tick(time.monotonic())
        return await super().on_tick(counter)

    async def _drain_tick(self, now: float) -> None:
        in_flight = len(self.server_state.tasks)  # one task per HTTP request being answered, streams included
        if self._last_report < 0 or now - self._last_report >= 5.0:
            self._last_report = now
            log.info("draining: %d request(s) in flight, %.0f s left", in_flight, self.drain.left_s(now))
        if in_flight and not self.drain.expired(now):
            return
        if in_flight:
            log.warning("drain timeout: ending %d request(s) still in flight with an error", in_flight)
            await self.drain.expire()
        else:
            log.info("drained: nothing in flight; shutting down")
        # uvicorn annotates this int but only passes it to asyncio.wait_for, where seconds may be fractional
        self.config.timeout_graceful_shutdown = max(1.0, self.drain.left_s(time.monotonic()))  # pyright: ignore[reportAttributeAccessIssue]
        self.should_exit = True
