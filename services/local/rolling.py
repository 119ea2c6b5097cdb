"""`pdserve up`'s rolling restart (SIGHUP to it): every worker replaced by a fresh process, one at a time, never
leaving a role without a serving worker, so that requests under load see no failure.

For each worker, in start order, by the role it serves now (the workers' roles are read as its turn begins: one may
have switched since its launch, and a replacement must not undo that; worker_roles.py):
  - the only worker of its role: its replacement starts first (the same role, device and flags, a new worker id
    and /metrics port). Once the replacement has sent its first heartbeat (the gateways count it live and route
    to it), the old worker gets SIGTERM and drains; the next worker's turn comes when it has exited. This needs
    room for a second engine of the role meanwhile (device memory, cores).
  - one of several: it gets SIGTERM first and drains while the others of its role serve; once it has exited its
    replacement starts, and the next worker's turn comes when the replacement beats. At most one worker of a
    role is out at a time, and no extra device memory is needed.
A worker that switched role while its replacement was starting (the first case; a draining worker takes no switch)
is caught when it is read again before its SIGTERM: its replacement, of the role it left, is drained instead, and
its turn begins again in the role it serves now.

A drained worker exits by itself: it takes no new job, finishes its streams, and a prefill worker keeps the KV
it holds until decode has pulled it or its lease ran out (shared/worker/runtime.py). One still running after
`stop_bound_s` (its drain time and the grace) is killed, as `Stack.stop` does. A replacement that exits or does
not beat within `start_timeout_s` stops the rolling restart: where the old worker still serves (it started first)
the replacement is stopped and the old one serves on; otherwise the replacement is handed to the supervisor,
which restarts it as any exited service (or stops the stack, if it refused its configuration).

A state machine on the supervisor's loop (`tick`, every TICK_S on its main thread): it never blocks.
"""

from __future__ import annotations

import enum
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from services.local.stack import Replacement, Stack
from services.local.worker_roles import switched_message


class Phase(enum.Enum):
    STARTING = "starting"  # the replacement runs, no heartbeat from it yet
    DRAINING = "draining"  # the old worker got SIGTERM and has not exited yet


@dataclass
class Handover:
    """One worker's turn."""

    name: str
    surge: bool  # its replacement starts before it stops (the only worker of its role)
    phase: Phase
    since: float  # when the phase began
    old: subprocess.Popen
    role: str  # the role it serves as the turn begins: its replacement's
    new: Replacement | None = None
    again: bool = False  # it switched role while its replacement started: that one drains, then the turn begins again


class RollingRestart:
    """Replaces every worker of `stack` (see the module docstring). `swapped(name)` is called when a replacement
    takes its worker's place in `stack.procs` (the supervisor supervises it from then on); `say` reports."""

    def __init__(
        self,
        stack: Stack,
        now: float,
        stop_bound_s: float,
        start_timeout_s: float,
        swapped: Callable[[str], None],
        say: Callable[[str], None],
    ) -> None:
        self.stack = stack
        self.started_at = now
        self.stop_bound_s = stop_bound_s
        self.start_timeout_s = start_timeout_s
        self.swapped = swapped
        self.say = say
        self.pending = [name for name in stack.procs if stack.role_of(name) is not None]  # start order
        self.current: Handover | None = None
        self.replaced: list[str] = []
        self.stopped: str | None = None  # why it stopped before the end

    @property
    def done(self) -> bool:
        return self.stopped is not None or (self.current is None and not self.pending)

    def tick(self, now: float) -> None:
        """Advance as far as the processes allow now."""
        while not self.done:
            if self.current is None:
                self._begin(self.pending.pop(0), now)
            elif not self._advance(self.current, now):
                return

    def _begin(self, name: str, now: float) -> None:
        old = self.stack.procs[name]
        if old.poll() is not None:  # exited, its restart is due: that gives a fresh process anyway
            self.say(f"{name} is not running (its restart is due); not replacing it")
            return
        for switched, (before, role) in self.stack.refresh_roles().items():
            self.say(switched_message(switched, before, role))
        role = self.stack.role_of(name)
        assert role is not None  # a worker
        running = [n for n in self.stack.procs if self.stack.procs[n].poll() is None]
        surge = sum(self.stack.role_of(n) == role for n in running) == 1
        turn = self.current = Handover(name, surge, Phase.STARTING, now, old, role)
        if surge:
            self._start(turn, now)
            self.say(f"{name} (pid {old.pid}, {role}): its replacement (pid {self._new(turn).proc.pid}) starts first")
        else:
            self.stack.retire(name)
            self._stop_old(turn, now)
            self.say(f"{name} (pid {old.pid}) drains while the other {role} workers serve")

    def _advance(self, turn: Handover, now: float) -> bool:
        """One step of `turn`; False while it waits on a process."""
        if turn.phase is Phase.STARTING:
            new = self._new(turn)
            if not self.stack.beats(turn.name, new.metrics_port):
                if new.proc.poll() is None and now - turn.since < self.start_timeout_s:
                    return False
                self._give_up(turn, now)
                return True
            if turn.surge and self._switched_meanwhile(turn):
                self._drain_replacement(turn, now)
            elif turn.surge:  # the process in its place now: the old one, or a restart of it if it died meanwhile
                turn.old = self.stack.retire(turn.name)
                self._swap_in(turn)
                self._stop_old(turn, now)
            else:
                self._swap_in(turn)
                self._finish(turn)
            return True
        if turn.old.poll() is None:
            if now - turn.since < self.stop_bound_s:
                return False
            self.say(f"{turn.name} (pid {turn.old.pid}) still runs {self.stop_bound_s:g} s after SIGTERM; killing it")
            turn.old.kill()
        turn.old.wait()
        self.stack.handover.remove(turn.old)
        if turn.again:
            self.pending.insert(0, turn.name)
            self.current = None
        elif turn.surge:
            self._finish(turn)
        else:
            self._start(turn, now)
        return True

    def _switched_meanwhile(self, turn: Handover) -> bool:
        """Whether the worker serving in `turn.name`'s place switched role since the turn began (read now)."""
        for switched, (before, role) in self.stack.refresh_roles([turn.name]).items():
            self.say(switched_message(switched, before, role))
        return self.stack.role_of(turn.name) != turn.role

    def _drain_replacement(self, turn: Handover, now: float) -> None:
        """The replacement serves the role the worker left: it drains (never swapped in), the worker serves on, and
        its turn begins again once the replacement has exited."""
        new = self._new(turn)
        self.say(f"{turn.name} switched to {self.stack.role_of(turn.name)} while its {turn.role} replacement (pid "
                 f"{new.proc.pid}) started: that one drains, and {turn.name}'s turn begins again")  # fmt: skip
        turn.old, turn.new, turn.again = new.proc, None, True
        self._stop_old(turn, now)

    def _start(self, turn: Handover, now: float) -> None:
        turn.new = self.stack.start_replacement(turn.name)
        turn.phase, turn.since = Phase.STARTING, now

    def _stop_old(self, turn: Handover, now: float) -> None:
        """SIGTERM to the old worker, retired already (out of `procs`: its exit is no crash to restart)."""
        if turn.old.poll() is None:
            turn.old.send_signal(signal.SIGTERM)
        turn.phase, turn.since = Phase.DRAINING, now

    def _swap_in(self, turn: Handover) -> None:
        self.stack.swap_in(self._new(turn))
        self.swapped(turn.name)

    def _finish(self, turn: Handover) -> None:
        self.replaced.append(turn.name)
        self.say(f"{turn.name} replaced: pid {self._new(turn).proc.pid} serves ({turn.old.pid} exited)")
        self.current = None

    def _give_up(self, turn: Handover, now: float) -> None:
        new = self._new(turn)
        code = new.proc.poll()
        why = f"exited ({code})" if code is not None else f"sent no heartbeat within {self.start_timeout_s:g} s"
        if turn.surge:  # the old worker was never touched: it serves on
            if code is None:
                new.proc.kill()
                new.proc.wait()
            self.stack.handover.remove(new.proc)
            outcome = f"{turn.name} (pid {turn.old.pid}) serves on"
        else:  # the supervisor takes it: restarted as any service that exited (or the stack stops, if refused)
            self._swap_in(turn)
            outcome = f"the supervisor takes {turn.name} over"
        self.stopped = f"{turn.name}'s replacement (pid {new.proc.pid}) {why}; {outcome}"
        self.current = None

    @staticmethod
    def _new(turn: Handover) -> Replacement:
        if turn.new is None:
            raise RuntimeError(f"{turn.name}: no replacement started")
        return turn.new
