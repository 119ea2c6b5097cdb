"""One request's updates on the NATS side: events in (from the backend's one listener), ordered updates out,
who holds the request now, the events it lacks, and the deadlines that keep a lost worker from hanging the client.

Holder: the worker responsible for the request's next event (TokenEvent: a worker announces a job it takes with
a TakenEvent; every event makes its worker the holder, until a QueuedEvent hands the request to a job queue). A
job routed to one worker's own queue (KV-aware routing, kv_routing.py) is held by that worker from dispatch, a
decode job routed to a decode worker's own queue from its QueuedEvent (`routed_to`): nothing else would take
it, so if that worker dies before taking it, the request moves as if it had. A worker's event hands it the
request only from the position where the current holder's stage began: an earlier stage's event arriving late (a
resent one, say: the prefill worker's first token) leaves the request with the later stage's worker.
NatsBackend's watchdog asks `why_move` and, when the holder died or stalled, moves the request on to a
new attempt (`move_on`): prompt + tokens so far go to another worker, the old attempt's events are stale.

Lost events (token events are core NATS: one published while the bus was away is gone): `resend_from` says when
to ask the workers for the events from the first position not delivered (resend_asks.py): a gap (later positions
waiting) for GAP_ASK_S, no event since the gateway got back to NATS, or a holder silent for SILENT_ASK_S; asked
again after ASK_AGAIN_S, doubling to ASK_AGAIN_MAX_S while the cause lasts. A gap that outlives `gap_s` of asking
(its publisher is gone: nobody can send it again) moves the request, as a dead holder does.

Deadlines, each ending the request with a failed update and a cancel upstream:
  - first token: `first_token_s` after dispatch (covers queueing for a free worker);
  - progress: `progress_s` after the last deliverable update.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.gateway.backend import Update
from services.gateway.ordering import TokenOrder
from services.gateway.prefill_path import PathChoice
from shared.messages import FailedEvent, PrefillJob, QueuedEvent, TakenEvent, TokenEvent

GAP_ASK_S = 0.2  # the two publishers of a request are milliseconds apart: a gap this old is a lost event
SILENT_ASK_S = 2.0  # a streaming worker sends an event every step: this long without one, its last may be lost
ASK_AGAIN_S = 0.5  # an ask not answered (its worker not reconnected yet, say) goes again after this, doubling
ASK_AGAIN_MAX_S = 8.0


@dataclass(frozen=True)
class Deadlines:
    first_token_s: float
    progress_s: float
    gap_s: float = 5.0  # a gap asked for this long (connected) moves the request: nobody can send it again


class RequestUpdates:
    """Implements backend.RequestStream. `push`/`put` are called from the event loop's NATS callback."""

    def __init__(
        self,
        request_id: str,
        deadlines: Deadlines,
        cancel: Callable[[str], Awaitable[None]],
        forget: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        job: PrefillJob | None = None,
    ) -> None:
        self.request_id = request_id
        self.job = job  # as first dispatched (attempt 0): what a move re-sends
        self.prompt_tokens = len(job.prompt_token_ids) if job is not None else 0
        self.holder: str | None = None  # worker id, or None while the request waits in a job queue
        self.queued_for: str | None = None  # the worker whose own queue holds the job, until an event arrives
        self.queued_for_decode = False  # ... and whether that queue is its decode one (else its prefill one)
        self.migrations = 0
        self.trace_headers: dict[str, str] = {}  # NATS headers carrying the request's trace context
        self.prefill_path: PathChoice | None = None  # the path its first dispatch took, and why (prefill_path.py)
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
        self._event_at: float | None = None  # when the last event of the current attempt arrived
        self._holder_from = 0  # the position where the holder's stage began: earlier stages' events do not hand over
        self._asked_at: float | None = None  # when the events it lacks were last asked for
        self._asks = 0  # asks since the events stopped lacking
        self._ended = False
        self._given_up = False  # the gateway ended it (give_up); the client may not have read that yet
        self._held_since = self._opened_at  # when the holder took the request
        self._tokens_at: float | None = None  # when the current attempt last delivered tokens
        self._stage_takers: dict[tuple[int, int], str] = {}  # (attempt, first position) → the worker that took it
        self._duplicates: set[tuple[int, str]] = set()  # (attempt, worker) running a stage another worker took

    @property
    def opened_at(self) -> float:
        """When the request was opened (its clock): its TTFT counts from here."""
        return self._opened_at

    @property
    def attempt(self) -> int:
        return self._order.attempt

    @property
    def delivered(self) -> int:
        """Output tokens delivered so far."""
        return self._order.delivered

    @property
    def tokens(self) -> list[int]:
        """The output token ids delivered so far."""
        return self._order.tokens

    @property
    def first_token_seen(self) -> bool:
        return self._order.delivered > 0

    @property
    def finished(self) -> bool:
        return self._ended or self._order.finished or self._given_up

    def push(self, event: TokenEvent) -> None:
        now = self._clock()
        if self._is_duplicate_taker(event):
            return
        updates = self._order.push(event)
        if updates:
            self._progress_at = now
            self._tokens_at = now
        if event.attempt == self._order.attempt:
            self._event_at = now
        if event.attempt == self._order.attempt and event.worker_id:
            queued = isinstance(event, QueuedEvent)
            position = event.seq if not isinstance(event, FailedEvent) else self._holder_from
            if not queued and event.worker_id != self.holder and position >= self._holder_from:
                self.holder, self._held_since, self._holder_from = event.worker_id, now, position
                self.queued_for = None  # taken (or answered): no longer waiting in a worker's own queue
            elif queued and event.worker_id == self.holder:  # a later stage's taker may have spoken first
                # a job in a worker's own queue (a routed decode job) is that worker's: it moves if it dies
                self.holder, self._held_since, self.queued_for = event.routed_to, now, event.routed_to
                self.queued_for_decode = True
                self._holder_from = event.seq
            elif event.worker_id == self.holder:
                self.queued_for = None
        for update in updates:
            self._queue.put_nowait(update)
        gap = self._order.gap()
        self._gap_since = None if gap is None else (self._gap_since if self._gap_since is not None else now)
        self._wakeup.set()

    def _is_duplicate_taker(self, event: TokenEvent) -> bool:
        """True for the events of a second worker running the same stage of the same attempt: JetStream
        redelivers a job whose worker hung before announcing it, and that worker may wake up and run it too.
        The first to announce a stage (its first position) keeps it; the other's events are dropped, so two
        differently sampled continuations never interleave."""
        who = (event.attempt, event.worker_id)
        if who in self._duplicates:
            return True
        if event.worker_id and isinstance(event, TakenEvent):
            first = self._stage_takers.setdefault((event.attempt, event.seq), event.worker_id)
            if first != event.worker_id:
                self._duplicates.add(who)
                return True
        return False

    def routed(self, worker_id: str) -> None:
        """The job was published to `worker_id`'s own queue: that worker holds the request from now."""
        self.holder, self._held_since, self.queued_for = worker_id, self._clock(), worker_id
        self.queued_for_decode = False
        self._holder_from = 0

    def put(self, update: Update) -> None:
        """An update from the gateway itself (shutdown)."""
        self._queue.put_nowait(update)
        self._wakeup.set()

    def give_up(self, message: str, status: int) -> None:
        """End the request with an error from the gateway (it could not be moved): nothing watches it more."""
        self._given_up = True
        self.put(Update([], "error", message, status=status))

    def resend_from(self, reconnected_at: float | None = None) -> tuple[int, str] | None:
        """(the first position not delivered, why) when the workers should be asked for this attempt's events
        again now, or None (module docstring). `reconnected_at`: when the gateway last got back to NATS (what was
        published while it was away is lost). Counts the ask: call it only to ask."""
        if self.finished:
            return None
        now = self._clock()
        heard = self._event_at if self._event_at is not None else self._opened_at
        why = None
        if self._order.gap() is not None and self._gap_since is not None and now - self._gap_since >= GAP_ASK_S:
            why = "gap"
        elif reconnected_at is not None and heard < reconnected_at:
            why = "reconnected"
        elif self.holder is not None and self.queued_for is None and now - max(heard, self._held_since) >= SILENT_ASK_S:
            why = "silent"
        if why is None:
            self._asked_at, self._asks = None, 0
            return None
        again = min(ASK_AGAIN_S * 2 ** (self._asks - 1), ASK_AGAIN_MAX_S)
        if self._asked_at is not None and now - self._asked_at < again:
            return None
        self._asked_at, self._asks = now, self._asks + 1
        return self._order.delivered, why

    def why_move(
        self,
        last_beat: Callable[[str], float | None],
        worker_ttl_s: float,
        stall_s: float,
        reconnected_at: float | None = None,
    ) -> str | None:
        """Why the request must move to another worker now, or None. Its holder is dead when no heartbeat
        came for worker_ttl_s (one never heard from gets worker_ttl_s from when it took the request); it has
        stalled when, after this attempt delivered tokens, nothing more came for stall_s. A gap that lasted gap_s
        since the gateway was last (re)connected at `reconnected_at` (asked for all along: resend_from) cannot be
        filled: the worker that sent those positions is gone or forgot them; the request moves (its new attempt
        starts at the gap). Before any token of the attempt a long queue or prefill is normal: only the heartbeat
        and the first-token deadline judge it. Lost events of a live holder are asked for again, not moved for."""
        if self.finished:
            return None
        now = self._clock()
        gap = self._order.gap()
        if gap is not None and self._gap_since is not None:
            since = max(self._gap_since, reconnected_at or self._gap_since)
            if now - since > self.deadlines.gap_s and self._asks:
                return f"output positions {gap[0]}-{gap[1] - 1} never arrived, though asked for {self._asks} times"
        if self.holder is None:
            return None
        heard = max(last_beat(self.holder) or 0.0, self._held_since)
        if now - heard > worker_ttl_s:
            return f"worker {self.holder} sent no heartbeat for {now - heard:.1f} s"
        if self._tokens_at is None or self.queued_for is not None:  # waiting in its holder's own queue: a busy
            return None  # worker takes it when it has room (as from the shared queue); only its death moves it
        last = max(self._tokens_at, self._held_since)
        if now - last > stall_s:
            return f"worker {self.holder} produced no token for {stall_s:g} s"
        return None

    def move_on(self) -> int:
        """Start the next attempt (the caller re-dispatches it); returns its number."""
        attempt = self._order.attempt + 1
        self._order.move_on(attempt)
        self.migrations += 1
        self.holder, self._held_since, self._tokens_at = None, self._clock(), None
        self._gap_since, self.queued_for = None, None
        self._holder_from, self._event_at, self._asked_at, self._asks = 0, None, None, 0
        self._wakeup.set()
        return attempt

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
        """The nearest deadline, and the failure to report when it passes. (A gap is no deadline: its events are
        asked for again, and a gap nobody can fill moves the request: why_move.)"""
        d = self.deadlines
        if self._progress_at is None:
            deadline, what, limit = self._opened_at + d.first_token_s, "no first token", d.first_token_s
        else:
            deadline, what, limit = self._progress_at + d.progress_s, "no progress", d.progress_s
        return deadline, Update([], "error", f"{what} within {limit:g} s; the request was cancelled", status=504)
