"""When the supervisor restarts a service that exited, and when it gives up: the policy and one service's
record of starts and exits. Pure bookkeeping on the caller's clock (monotonic seconds), no processes.

A service that exits is restarted after a delay that starts at `first_delay_s` and doubles with each exit up to
`max_delay_s`; once a run lasted `healthy_after_s` the next exit starts from `first_delay_s` again. A service that
exited `max_exits` times within `window_s` is crash-looping: the supervisor gives up on the stack.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    healthy_after_s: float = 30.0
    """A run at least this long counts as healthy: the delay resets."""
    max_exits: int = 5
    window_s: float = 60.0
    """`max_exits` exits of one service within this many seconds stop the stack."""

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.max_exits < 1 or self.window_s <= 0 or self.healthy_after_s <= 0:
            raise ValueError("max_exits must be >= 1, window_s and healthy_after_s positive")


class RestartRecord:
    """One service's starts and exits under `policy`, from its first start (`now`). `exited(now)` at every exit
    answers how long to wait before restarting it, or None: give up; `restarted(now)` when it was started again."""

    def __init__(self, policy: RestartPolicy, now: float) -> None:
        self.policy = policy
        self.started_at = now
        self.restarts = 0  # restarts done so far (the first start is not one)
        self._delay_s = policy.first_delay_s  # the wait before the next restart
        self._exits: deque[float] = deque()  # exit times within the window, oldest first

    def restarted(self, now: float) -> None:
        self.started_at = now
        self.restarts += 1

    def exited(self, now: float) -> float | None:
        """The delay before restarting, or None when this exit makes `max_exits` within `window_s`."""
        policy = self.policy
        if now - self.started_at >= policy.healthy_after_s:
            self._delay_s = policy.first_delay_s
        self._exits.append(now)
        while self._exits and now - self._exits[0] > policy.window_s:
            self._exits.popleft()
        if len(self._exits) >= policy.max_exits:
            return None
        delay, self._delay_s = self._delay_s, min(self._delay_s * 2, policy.max_delay_s)
        return delay

    @property
    def recent_exits(self) -> int:
        """Exits counted in the current window (as of the last exit)."""
        return len(self._exits)
