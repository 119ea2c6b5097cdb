"""Which attempts were cancelled, remembered for a while: a cancelled attempt's job may still arrive later
(a redelivery after ack_wait, a decode job published by a worker that was hung when its request moved on)."""

from __future__ import annotations

import time
from collections import OrderedDict

from shared.messages import Cancel

CANCEL_MEMORY_S = 600.0
MAX_REMEMBERED_CANCELS = 100_000


class CancelMemory:
    """Request id → (cancelled up to this attempt, None = all; when), oldest first. Bounded by age
    (CANCEL_MEMORY_S) and count (MAX_REMEMBERED_CANCELS): the oldest are forgotten first."""

    def __init__(self, memory_s: float = CANCEL_MEMORY_S, max_count: int = MAX_REMEMBERED_CANCELS) -> None:
        self.memory_s = memory_s
        self.max_count = max_count
        self._cancelled: OrderedDict[str, tuple[int | None, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cancelled)

    def is_cancelled(self, request_id: str, attempt: int) -> bool:
        entry = self._cancelled.get(request_id)
        return entry is not None and (entry[0] is None or attempt <= entry[0])

    def remember(self, cancel: Cancel, now: float | None = None) -> None:
        """Record `cancel` (widening an earlier one of the same request, never narrowing it); forget what is
        too old or too many."""
        now = time.monotonic() if now is None else now
        old = self._cancelled.pop(cancel.request_id, None)
        up_to = cancel.up_to_attempt
        if old is not None and (old[0] is None or (up_to is not None and old[0] > up_to)):
            up_to = old[0]
        self._cancelled[cancel.request_id] = (up_to, now)
        while self._cancelled and (
            len(self._cancelled) > self.max_count or next(iter(self._cancelled.values()))[1] < now - self.memory_s
        ):
            self._cancelled.popitem(last=False)
