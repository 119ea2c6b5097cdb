"""One request's updates on the NATS side: events in (from the backend's one listener), ordered updates out,
and the deadlines that keep a lost worker or a lost event from hanging the client.

Deadlines, each ending the request with a failed update and a cancel upstream:
  - first token: `first_token_s` after dispatch (covers queueing for a free worker);
  - progress: `progress_s` after the last deliverable update;
  - gap: `gap_s` after later positions arrived while an earlier one is missing (the two publishers of a
    request are milliseconds apart, so a gap that lasts is a lost event, not a slow one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.gateway.backend import Update
from services.gateway.ordering import TokenOrder
from shared.messages import TokenEvent


@dataclass(frozen=True)
class Deadlines:
    first_token_s: float
    progress_s: float
    gap_s: float = 5.0


class RequestUpdates:
    """Implements backend.RequestStream. `push`/`put` are called from the event loop's NATS callback."""

    def __init__(
        self,
        request_id: str,
        deadlines: Deadlines,
        cancel: Callable[[str], Awaitable[None]],
        forget: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request_id = request_id
        self.deadlines = deadlines
        self._cancel = cancel
        self._forget = forget
        self._clock = clock
        self._order = TokenOrder()
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._wakeup = asyncio.Event()  # set on every event: the deadline may have moved
        self._opened_at = clock()
        self._progress_at: float | None = None  # when the last deliverable update arrived
        self._gap_since: float | None = None
        self._ended = False

    def push(self, event: TokenEvent) -> None:
        now = self._clock()
        updates = self._order.push(event)
        if updates:
            self._progress_at = now
        for update in updates:
            self._queue.put_nowait(update)
        gap = self._order.gap()
        self._gap_since = None if gap is None else (self._gap_since or now)
        self._wakeup.set()

    def put(self, update: Update) -> None:
        """An update from the gateway itself (shutdown)."""
        self._queue.put_nowait(update)
        self._wakeup.set()

    def __aiter__(self) -> RequestUpdates:
        return self

    async def __anext__(self) -> Update:
        if self._ended:
            raise StopAsyncIteration
        update = await self._next()
        self._ended = update.finished
        return update

    async def aclose(self) -> None:
        self._ended = True
        self._forget(self.request_id)

    async def _next(self) -> Update:
        while self._queue.empty():
            deadline, failure = self._deadline()
            wait = deadline - self._clock()
            if wait <= 0:
                await self._cancel(self.request_id)
                return failure
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wakeup.wait()
        return self._queue.get_nowait()

    def _deadline(self) -> tuple[float, Update]:
        """The nearest deadline, and the failure to report when it passes."""
        d = self.deadlines
        if self._progress_at is None:
            deadline, what, limit = self._opened_at + d.first_token_s, "no first token", d.first_token_s
        else:
            deadline, what, limit = self._progress_at + d.progress_s, "no progress", d.progress_s
        status = 504
        gap = self._order.gap()
        if gap is not None and self._gap_since is not None and self._gap_since + d.gap_s < deadline:
            deadline, limit, status = self._gap_since + d.gap_s, d.gap_s, 502
            what = f"tokens at output positions {gap[0]}-{gap[1] - 1} never arrived"
        return deadline, Update([], "error", f"{what} within {limit:g} s; the request was cancelled", status=status)
