"""`pdserve up` as a supervisor: it starts a Stack, keeps its services running, and stops all of it on a signal.

  - SIGTERM or SIGINT (explicit handlers, so a SIGINT ignored from a script's background job counts too): the
    gateway and workers get SIGTERM and drain, for at most their drain time plus STOP_GRACE_S, then SIGKILL;
    then nats-server and redis-server stop. A second signal kills what still runs at once.
  - The supervisor itself killed (SIGKILL): every child has the parent-death signal (children.py) and drains.
  - A service that exits (a worker, the gateway, nats-server or redis-server) is restarted after a backoff
    (restarts.py), logged, and counted in `pdserve:supervisor_restarts_total{service=...}`, served on the
    supervisor's own /metrics port; the others keep serving (the gateway moves a dead worker's requests, the
    services reconnect to a restarted nats/redis, whose data directory survives). A service that keeps dying
    (RestartPolicy.max_exits within window_s) stops the stack with a message naming it and its log.
  - A service that refuses its configuration (exit status EXIT_REFUSED, 2: a bad flag or setting, a checkpoint
    it cannot load, a port in use) is not restarted — it would refuse again —: the stack stops at once with the
    end of its log (its reason), and `run()` returns 2.
  - SIGHUP: a rolling restart of every worker (rolling.py), without a failed request; one at a time, it runs
    while the loop goes on tending the services. A SIGHUP during one is ignored (said).
  - A worker may switch role while it runs (the admin API, the planner): once the stack is ready, the loop reads every
    running worker's role every POLL_S (worker_roles.py says why from its /metrics), so that a restart or a rolling
    restart brings a switched worker back in the role it serves, not the one it was launched with.

All of it runs on the main thread: the signal handlers only count, the loop acts; children are started
from the main thread, which their parent-death signal is tied to.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, start_http_server

from services.local.infra import ServerProcess
from services.local.restarts import RestartPolicy, RestartRecord
from services.local.rolling import RollingRestart
from services.local.stack import Stack
from services.local.worker_roles import POLL_S, switched_message
from shared.telemetry.lifecycle import EXIT_GRACE_S, EXIT_REFUSED

STOP_GRACE_S = EXIT_GRACE_S  # past the services' drain time: their last flush and exit before SIGKILL
TICK_S = 0.2


class GiveUp(Exception):
    """The stack cannot go on: a service crash-loops, a server does not come back, or it never got ready."""

    status = 1  # what `pdserve up` exits with


class Refused(GiveUp):
    """A service refused its configuration (exit status EXIT_REFUSED): restarting it would not help."""

    status = EXIT_REFUSED


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class Supervisor:
    """Runs `stack` until a signal or a give-up (see the module docstring). `run()` blocks; `on_ready` is called
    once, the first time the gateway's /ready answers 200. `metrics_port` 0: any free port (`metrics_url`)."""

    def __init__(
        self,
        stack: Stack,
        drain_timeout_s: float,
        policy: RestartPolicy | None = None,
        ready_timeout_s: float = 120.0,
        metrics_port: int = 0,
        on_ready: Callable[[Supervisor], None] = lambda _: None,
    ) -> None:
        self.stack = stack
        self.drain_timeout_s = drain_timeout_s
        self.policy = policy or RestartPolicy()
        self.ready_timeout_s = ready_timeout_s
        self.on_ready = on_ready
        self.signals = 0  # SIGTERM / SIGINT received: 1 = drain and stop, 2 = stop at once
        self.hangups = 0  # SIGHUPs not acted on yet: each asks for a rolling restart
        self.rolling: RollingRestart | None = None  # the rolling restart under way
        self.rolled = 0  # rolling restarts completed
        self.records: dict[str, RestartRecord] = {}  # service → its starts and exits, from launch on
        self._due: dict[str, float] = {}  # service that exited → when its restart is due
        self._roles_read_at: float | None = None  # when the workers' roles were last read
        disable_created_metrics()  # as the services do: no `_created` series beside the counts
        registry = CollectorRegistry()
        self._restarts = Counter(
            "pdserve:supervisor_restarts", "Services restarted after they exited.", ["service"], registry=registry
        )
        self._metrics_server, _ = start_http_server(metrics_port, addr=stack.spec.host, registry=registry)
        self.metrics_url = f"http://{stack.spec.host}:{self._metrics_server.server_port}/metrics"

    def run(self) -> int:
        """Launch, supervise, stop. 0 after a signal, 1 after giving up (the reason printed)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            self.stack.launch()
            launched = time.monotonic()
            self.records = {name: RestartRecord(self.policy, launched) for name in self._services()}
            for name in self.records:
                self._restarts.labels(service=name)  # every service's count shows, from 0
            ready = False
            while not self.signals:
                self._tend(time.monotonic())
                if not ready:
                    ready, last = self.stack.probe_ready()
                    if ready:
                        self.on_ready(self)
                    elif time.monotonic() - launched > self.ready_timeout_s:
                        raise GiveUp(f"the stack is not ready after {self.ready_timeout_s:g} s: {last}")
                else:
                    self._read_roles(time.monotonic())
                    self._roll(time.monotonic())
                time.sleep(TICK_S)
            _say(f"signal received: draining the services (at most {self.drain_timeout_s + STOP_GRACE_S:g} s); "
                 "signal again to stop at once")  # fmt: skip
            return 0
        except GiveUp as exc:
            _say(f"{exc}; stopping the stack")
            return exc.status
        finally:
            self.stack.stop(self.drain_timeout_s + STOP_GRACE_S, abort=lambda: self.signals >= 2)
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1  # only counts: the loop (or Stack.stop's abort) acts on it

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self.hangups += 1  # only counts: the loop acts on it once the stack is ready

    def _roll(self, now: float) -> None:
        """Start the rolling restart a SIGHUP asked for, or take the one under way a step further."""
        if self.hangups:
            if self.rolling is None:
                drain = self.drain_timeout_s + STOP_GRACE_S
                self.rolling = RollingRestart(self.stack, now, drain, self.ready_timeout_s, self._swapped, _say)
                _say(f"SIGHUP: rolling restart of {len(self.rolling.pending)} workers, one at a time")
            else:
                _say("SIGHUP: a rolling restart is under way already; ignored")
            self.hangups = 0
        if self.rolling is None:
            return
        self.rolling.tick(now)
        if self.rolling.done:
            took = time.monotonic() - self.rolling.started_at
            if self.rolling.stopped:
                _say(f"rolling restart stopped after {took:.1f} s: {self.rolling.stopped}")
            else:
                self.rolled += 1
                _say(f"rolling restart done: {len(self.rolling.replaced)} workers replaced in {took:.1f} s")
            self.rolling = None

    def _read_roles(self, now: float) -> None:
        """Every POLL_S: the role each running worker serves (the stack keeps it for the worker's restart)."""
        if self._roles_read_at is not None and now - self._roles_read_at < POLL_S:
            return
        for name, (before, role) in self.stack.refresh_roles().items():
            _say(switched_message(name, before, role))
        self._roles_read_at = time.monotonic()  # after the reads: a slow round does not start the next at once

    def _swapped(self, name: str) -> None:
        """A rolling restart put a new process in `name`'s place: a restart of the old one, if due, is moot; the
        new one's record starts afresh."""
        self._due.pop(name, None)
        self.records[name] = RestartRecord(self.policy, time.monotonic())

    def _services(self) -> dict[str, subprocess.Popen | None]:
        """Every supervised child by name, the workers and the gateway first, then the private servers."""
        return {**self.stack.procs, **{server.name: server.proc for server in self.stack.infra}}

    def _tend(self, now: float) -> None:
        """Note the services that exited (scheduling their restarts or giving up); restart those due."""
        for name, proc in self._services().items():
            if name in self._due or proc is None or proc.poll() is None:
                continue
            record = self.records[name]
            if proc.returncode == EXIT_REFUSED and self._server(name) is None:  # a pdserve service's refusal
                raise Refused(f"{name} refused its configuration (exit code {EXIT_REFUSED}), so it is not "
                              f"restarted. {self._log_hint(name, quote=True)}")  # fmt: skip
            delay = record.exited(now)
            what = f"{name} exited ({_describe(proc.returncode)}) after {now - record.started_at:.1f} s"
            if delay is None:
                raise GiveUp(f"{what}: {record.recent_exits} exits within {self.policy.window_s:g} s. "
                             f"{self._log_hint(name)}")  # fmt: skip
            role = self.stack.role_of(name)
            again = f"restarting it in {delay:g} s" + (f" as {role}" if role is not None else "")
            _say(f"{what}; {again}. {self._log_hint(name)}")
            self._due[name] = now + delay
        for name, due in list(self._due.items()):
            if due <= now and not self.signals:
                del self._due[name]
                self._restart(name)
                self.records[name].restarted(time.monotonic())
                self._restarts.labels(service=name).inc()

    def _restart(self, name: str) -> None:
        server = self._server(name)
        if server is None:
            self.stack.respawn(name)
            return
        try:
            server.restart()  # same port, same data directory; waits until it listens
        except RuntimeError as exc:  # counted as one more exit by the next _tend
            _say(str(exc))
            if server.proc is not None and server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()

    def _server(self, name: str) -> ServerProcess | None:
        return next((server for server in self.stack.infra if server.name == name), None)

    def _log_hint(self, name: str, quote: bool = False) -> str:
        """Where `name`'s output is, for a person reading the message; `quote`: its end too (a service's reason)."""
        server = self._server(name)
        if server is not None:  # in its data directory, removed when the stack stops: quote its end now
            tail = _tail(server.log_path)
            return f"The end of its log ({server.log_path}): {tail}" if tail else f"Its log: {server.log_path}"
        path = self.stack.log_path(name)
        if quote and path is not None and (tail := _tail(path, lines=2)):
            return f"The end of its log ({path}): {tail}"
        role = name.split("-")[0]
        return f"Its log: {path}" if path else f"Its output is above (lines tagged '{role}')."


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _say(message: str) -> None:
    print(f"pdserve up: {message}", file=sys.stderr, flush=True)
