"""The jobs a worker has in hand: one entry per attempt key (`job.key`, e.g. "req~1"), from the moment the job
is taken until the worker is done with the request.

An entry holds the job, its JetStream message until the message is settled (acked or terminated), the phase
the request is in here, its spans and, for a layer-streamed prefill, the state of its hand-on: everything the
worker keeps of a request, in one record. Ledger and entries are generic over the job kind (messages.Job): a role
takes one kind only. Settling a message and forgetting an entry are separate: a streaming
worker acks its job once the request is in the engine, and keeps the entry until the last token.

Pure bookkeeping: no NATS client, no engine. A message is anything with `ack()`, `term()` and
`in_progress()` coroutines (nats-py's Msg; a fake in the unit tests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol

from opentelemetry.trace import Span

from shared.messages import Cancel, Job
from shared.worker.cancels import CancelMemory

log = logging.getLogger(__name__)


class JobMessage(Protocol):
    def ack(self) -> Awaitable[Any]: ...
    def term(self) -> Awaitable[Any]: ...
    def in_progress(self) -> Awaitable[Any]: ...


class Phase(Enum):
    PULLING = "pulling"  # decode: its KV is being pulled (a task owns the entry)
    PREFILLING = "prefilling"  # in the engine, before its first token
    HANDING_ON = "handing_on"  # prefill: first token out, the decode job being published (a task owns it)
    RUNNING = "running"  # in the engine, decoding: every token streams back

    @property
    def in_engine(self) -> bool:
        return self in (Phase.PREFILLING, Phase.RUNNING)


@dataclass(eq=False)
class StreamedHandOn:
    """Prefill, a layer-streamed job (services/prefill/worker.py): handed on as its last chunk starts, before its
    first token exists. Two halves end it, in either order: the decode job published (a task) and the first
    token come (the engine's output); whichever ends last forgets the entry."""

    published: bool = False
    first_token_came: bool = False

    @property
    def done(self) -> bool:
        return self.published and self.first_token_came


@dataclass(eq=False)
class Entry(Generic[Job]):
    job: Job
    msg: JobMessage | None  # until settled (acked or terminated)
    phase: Phase
    span: Span  # `process <subject>`: opened with the entry, ended once (spans.end_once)
    decode_span: Span | None = None  # while it decodes here (decode and mixed roles)
    cancelled: bool = False  # a cancel covered it while a task owned it: the task drops it at its next step
    # Another choice of a group job (worker/choices.py): the entry of the group's key owns the message and span.
    group_key: str | None = None
    streamed: StreamedHandOn | None = None  # prefill: the job's KV streams layer by layer (set before it is added)

    @property
    def key(self) -> str:
        return self.job.key

    @property
    def reply_subject(self) -> str:
        return self.job.reply_subject


class JobLedger(Generic[Job]):
    """Attempt key → Entry. The one record of every job in hand; roles move entries through phases."""

    def __init__(self, cancels: CancelMemory) -> None:
        self.cancels = cancels
        self._entries: dict[str, Entry[Job]] = {}
        self._settling: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry[Job]]:
        return iter(list(self._entries.values()))

    def get(self, key: str) -> Entry[Job] | None:
        return self._entries.get(key)

    async def take(
        self, msg: JobMessage, job: Job, phase: Phase, open_span: Callable[[], Span], in_engine: bool = False
    ) -> Entry[Job] | None:
        """Register a fetched job in `phase`, its process span opened by `open_span` (called only then: a job
        not taken has no span to end); None when there is nothing to do:
        - its attempt was cancelled: the message is acked (done);
        - it is a redelivery of a job in hand: its newer message replaces the old one (JetStream no longer
          tracks that one), or is acked when the job in hand was acked already;
        - `in_engine`: the engine runs (or holds) it already, outside the ledger (its ack was lost): acked."""
        if self.cancels.is_cancelled(job.request_id, job.attempt):
            log.info("dropping job %s: attempt %d was cancelled", job.request_id, job.attempt)
            await settle(msg.ack())
            return None
        entry = self._entries.get(job.key)
        if entry is not None and entry.msg is not None:  # redelivered while in hand: settle the newer one
            entry.msg = msg
            log.info("job %s redelivered while in hand here; keeping the one running", job.key)
            return None
        if entry is not None or in_engine:  # running here already (its ack was lost): done by this one
            log.info("job %s redelivered while it runs here; acking the copy", job.key)
            await settle(msg.ack())
            return None
        entry = self._entries[job.key] = Entry(job, msg, phase, open_span())
        return entry

    def adopt(self, job: Job, phase: Phase, span: Span, group_key: str) -> Entry[Job] | None:
        """Register another choice of a job in hand (worker/choices.py): no message of its own, the group's span.
        None when its attempt was cancelled or it is in hand already."""
        if self.cancels.is_cancelled(job.request_id, job.attempt) or job.key in self._entries:
            return None
        entry = self._entries[job.key] = Entry(job, None, phase, span, group_key=group_key)
        return entry

    async def ack(self, key: str) -> None:
        """Ack the job's message (it is safely handed on or in the engine); the entry stays."""
        entry = self._entries.get(key)
        if entry is not None and entry.msg is not None:
            msg, entry.msg = entry.msg, None
            await settle(msg.ack())

    def finish(self, key: str) -> Entry[Job] | None:
        """The worker is done with the request (finished, or cancelled): forget it now, and ack its message if
        still held (in a task: callable from the engine's output callback, which cannot await)."""
        entry = self._entries.pop(key, None)
        if entry is not None and entry.msg is not None:
            msg, entry.msg = entry.msg, None
            task = asyncio.get_running_loop().create_task(settle(msg.ack()))
            self._settling.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._settling.discard)
        return entry

    async def term(self, key: str) -> Entry[Job] | None:
        """The job can never succeed: forget it, and tell JetStream never to redeliver its message."""
        entry = self._entries.pop(key, None)
        if entry is not None and entry.msg is not None:
            msg, entry.msg = entry.msg, None
            await settle(msg.term())
        return entry

    def forget_message(self, msg: JobMessage) -> None:
        """A job whose handling raised: forget every entry holding `msg` (the caller terminates it)."""
        for key in [k for k, e in self._entries.items() if e.msg is msg]:
            del self._entries[key]

    def in_progress(self) -> list[JobMessage]:
        """The messages still unsettled: report them in progress so JetStream does not redeliver them."""
        return [e.msg for e in self._entries.values() if e.msg is not None]

    def covered_by(self, cancel: Cancel) -> list[Entry[Job]]:
        """The entries `cancel` covers (its request, attempts up to its bound)."""
        rid = cancel.request_id
        return [e for e in self._entries.values() if e.job.request_id == rid and cancel.covers(e.job.attempt)]

    def count(self, phase: Phase) -> int:
        return sum(1 for e in self._entries.values() if e.phase is phase)

    def pop(self, key: str) -> Entry[Job] | None:
        """Forget an entry without settling its message (its owner settles it)."""
        return self._entries.pop(key, None)


async def settle(ack: Awaitable[Any]) -> None:
    """Await an ack / term / in-progress report; NATS being away only means JetStream redelivers later."""
    try:
        await ack
    except Exception as exc:
        log.warning("could not settle a job message: %s", exc)
