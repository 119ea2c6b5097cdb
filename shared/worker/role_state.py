"""A worker process's role over its life, as a state machine (pure: no I/O, no clock; the host drives it).

    SERVING(r) ──begin(t)──▶ LEAVING(r → t) ──left()──▶ STARTING(t) ──started(t)──▶ SERVING(t)
                               │ resumed()                 │ started(r): t could not start, r serves again
                               ▼                           ▼
                             SERVING(r)                  SERVING(r)
    any ──stop()──▶ STOPPING (a switch under way is called off: what the old role holds drains, the process exits)

LEAVING: the old role takes no new job and finishes (or hands on) what it holds; `resumed` when that did not settle
in time (it serves its old role again). STARTING: the old role is shut down (its KV server or pull clients closed,
its engine thread stopped); the new one is being set up over the same engine. Only one switch at a time: `begin`
while one is under way answers BUSY, to the same role SAME_ROLE, while stopping STOPPING.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.messages import Role, SwitchOutcome


class Phase(Enum):
    SERVING = "serving"
    LEAVING = "leaving"
    STARTING = "starting"
    STOPPING = "stopping"


@dataclass
class RoleState:
    role: Role  # the role serving now (LEAVING: the old one; STARTING: none serves, the one being left)
    phase: Phase = Phase.SERVING
    target: Role | None = None  # LEAVING / STARTING: the role switched to
    switches: int = 0  # switches completed

    @property
    def switching_to(self) -> Role | None:
        """What heartbeats say: the role it becomes, while a switch is under way."""
        return self.target if self.phase in (Phase.LEAVING, Phase.STARTING) else None

    def begin(self, to: Role) -> tuple[SwitchOutcome, str] | None:
        """A switch to `to` asked for: None when it begins (LEAVING), else why not."""
        if self.phase is Phase.STOPPING:
            return SwitchOutcome.STOPPING, "the worker is shutting down"
        if self.phase is not Phase.SERVING:
            return SwitchOutcome.BUSY, f"switching from {self.role} to {self.target} already"
        if to is self.role:
            return SwitchOutcome.SAME_ROLE, f"a {to} worker already"
        self.phase, self.target = Phase.LEAVING, to
        return None

    def left(self) -> None:
        """The old role is idle and shut down: the new one starts."""
        self._expect(Phase.LEAVING, "left")
        self.phase = Phase.STARTING

    def resumed(self) -> None:
        """What the old role held did not settle in time: it serves on."""
        self._expect(Phase.LEAVING, "resumed")
        self.phase, self.target = Phase.SERVING, None

    def started(self, role: Role) -> None:
        """`role` serves now: the target (the switch is done), or the old role again (the target failed to start)."""
        self._expect(Phase.STARTING, "started")
        if role is self.target:
            self.switches += 1
        self.phase, self.role, self.target = Phase.SERVING, role, None

    def stop(self) -> bool:
        """The process stops; True when this called a switch off."""
        called_off = self.phase in (Phase.LEAVING, Phase.STARTING)
        self.phase, self.target = Phase.STOPPING, None
        return called_off

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            raise ValueError(f"{what}() in phase {self.phase.value}, not {phase.value}")
