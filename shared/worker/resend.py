"""What a worker sent each request, kept to send again: token events travel on core NATS, so one published while
the bus was away (a restart, a failover, the gateway not subscribed yet on a server that just came back) is lost,
and only its publisher can repair the gap.

`SentEvents` records every token event the worker emits, per request attempt, in the order sent; consecutive
output events are kept as one growing run of tokens (a request's tokens are in the engine anyway; this is one list
of ints per request, not one struct per step). It answers with the events again:
  - when a gateway asks (`ResendRequest` on `pd.resend.<model>`: request, attempt, the first position it lacks):
    the attempt's events from that position on — taken and queued events at or past it, its tokens from it (in
    pieces of at most RESEND_TOKENS_PER_EVENT), and its end;
  - when this worker reconnects to NATS (nothing asked: the gateway may not know what it lost): the events of every
    attempt that sent any since shortly before the connection was lost (REPLAY_LOOKBACK_S: what was sent earlier
    reached the server while it was up), from its first.
The gateway's ordering drops what it already delivered, so a resent event is never a duplicate for the client.

Bounds: an attempt is kept while the worker has it in hand (`in_hand(key)`: its ledger entry) and for `keep_s` after
its last event once it has not (finished, handed on): a lost end (a FinishedEvent, a prefill worker's first token
and queued event) can still be asked for; past that, or past `max_ended` such attempts (oldest first), it is dropped.
A cancel drops the attempts it covers at once: the gateway no longer listens (`forget`).

`Resender` is the glue in a worker: it listens on the resend subject, watches the connection for reconnects and
prunes; the events go out through the worker's outbox, in order with everything else it publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.messages import (
    Cancel,
    FailedEvent,
    FinishedEvent,
    FinishReason,
    Logprob,
    QueuedEvent,
    ResendRequest,
    TakenEvent,
    TokenEvent,
    TokensEvent,
    attempt_key,
    decode_or_drop,
    resend_subject,
)
from shared.telemetry import metrics

log = logging.getLogger(__name__)

KEEP_S = 60.0  # an attempt no longer in hand is kept this long after its last event
MAX_ENDED = 4096  # ... and at most this many such attempts
RESEND_TOKENS_PER_EVENT = 1024  # a resent run of tokens goes in events of at most this many (a message stays small)
WATCH_S = 0.1  # how often the Resender looks for a reconnect
# After a reconnect, the attempts that sent anything since this long before the connection was seen lost are sent
# again: events written just before a server died can be lost with it, and noticing takes up to a WATCH_S tick
REPLAY_LOOKBACK_S = 5.0
PRUNE_S = 1.0


@dataclass
class _Run:
    """Consecutive output events of one attempt, as one: the first one's position and extras (prompt logprobs,
    cached tokens), every token (and its logprobs, when asked) since, and the end when it came."""

    first: TokensEvent | FinishedEvent
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def end(self) -> int:
        return self.first.seq + len(self.token_ids)

    def extends(self, event: TokensEvent | FinishedEvent) -> bool:
        return self.finish_reason is None and event.seq == self.end and event.worker_id == self.first.worker_id

    def add(self, event: TokensEvent | FinishedEvent) -> None:
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if isinstance(event, FinishedEvent):
            self.finish_reason = event.finish_reason

    def events_from(self, from_seq: int) -> list[TokensEvent | FinishedEvent]:
        """The run from position `from_seq` on (the first one's extras only if it starts there), in pieces; its
        end always, as the last piece (a FinishedEvent, maybe with no token)."""
        start = max(from_seq, self.first.seq)
        if start >= self.end:
            if self.finish_reason is None:
                return []
            start = self.end  # only the end is wanted
        first = self.first
        extras = start == first.seq
        out: list[TokensEvent | FinishedEvent] = []
        pos = start
        while True:
            upto = min(pos + RESEND_TOKENS_PER_EVENT, self.end)
            i, j = pos - first.seq, upto - first.seq
            tokens, lps = self.token_ids[i:j], self.logprobs[i:j] if self.logprobs else []
            fields = (first.request_id, first.attempt, pos, tokens, first.worker_id, first.prompt_tokens, lps)
            extra = (first.prompt_logprobs, first.cached_tokens) if extras and pos == start else ([], 0)
            last = upto >= self.end
            if last and self.finish_reason is not None:
                out.append(FinishedEvent(*fields, *extra, finish_reason=self.finish_reason))
            elif tokens:
                out.append(TokensEvent(*fields, *extra))
            if last:
                return out
            pos = upto


_Kept = TakenEvent | QueuedEvent | FailedEvent | _Run


@dataclass
class _Sent:
    """One attempt's events as sent, to one subject."""

    request_id: str
    attempt: int
    subject: str
    events: list[_Kept] = field(default_factory=list)
    last_at: float = 0.0

    def events_from(self, from_seq: int) -> list[TokenEvent]:
        out: list[TokenEvent] = []
        for kept in self.events:
            if isinstance(kept, _Run):
                out.extend(kept.events_from(from_seq))
            elif isinstance(kept, FailedEvent) or kept.seq >= from_seq:
                out.append(kept)
        return out


class SentEvents:
    """Every token event this worker sent, per attempt, for `replay` (module docstring). Pure state on the caller's
    clock; `in_hand(key)` says whether the worker still has an attempt (its ledger)."""

    def __init__(
        self,
        in_hand: Callable[[str], bool],
        keep_s: float = KEEP_S,
        max_ended: int = MAX_ENDED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.in_hand = in_hand
        self.keep_s = keep_s
        self.max_ended = max_ended
        self.clock = clock
        self._sent: OrderedDict[str, _Sent] = OrderedDict()  # attempt key → its events, least recently sent first

    def __len__(self) -> int:
        return len(self._sent)

    def record(self, subject: str, event: TokenEvent) -> None:
        key = attempt_key(event.request_id, event.attempt)
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = _Sent(event.request_id, event.attempt, subject)
        self._sent.move_to_end(key)
        sent.last_at = self.clock()
        if isinstance(event, TokensEvent | FinishedEvent):
            last = sent.events[-1] if sent.events else None
            if not (isinstance(last, _Run) and last.extends(event)):
                last = _Run(event)
                sent.events.append(last)
            last.add(event)
        else:
            sent.events.append(event)

    def replay(self, request_id: str, attempt: int, from_seq: int) -> tuple[str, list[TokenEvent]] | None:
        """(subject, the attempt's events from position `from_seq` on), or None when nothing of it is kept."""
        sent = self._sent.get(attempt_key(request_id, attempt))
        return None if sent is None else (sent.subject, sent.events_from(from_seq))

    def replay_all(self, since: float | None = None) -> list[tuple[str, list[TokenEvent]]]:
        """Every attempt kept that sent anything at or after `since` (all of them: None), all its events (after a
        reconnect: what the gateways lost is not known here)."""
        return [
            (sent.subject, sent.events_from(0))
            for sent in self._sent.values()
            if since is None or sent.last_at >= since
        ]

    def forget(self, cancel: Cancel) -> None:
        """The attempts `cancel` covers: nobody listens for them any more."""
        covered = [k for k, s in self._sent.items() if s.request_id == cancel.request_id and cancel.covers(s.attempt)]
        for key in covered:
            del self._sent[key]

    def prune(self) -> None:
        """Drop the attempts not in hand whose last event is older than keep_s, then the oldest such past
        max_ended."""
        now = self.clock()
        ended = [k for k in self._sent if not self.in_hand(k)]  # least recently sent first
        for key in ended:
            if now - self._sent[key].last_at > self.keep_s:
                del self._sent[key]
        ended = [k for k in ended if k in self._sent]
        for key in ended[: max(0, len(ended) - self.max_ended)]:
            del self._sent[key]


class Resender:
    """A worker's side of the resend protocol: answers `pd.resend.<model>`, resends everything after a reconnect,
    prunes. `emit(subject, event)` queues an event for publishing without recording it again."""

    def __init__(
        self, sent: SentEvents, model: str, emit: Callable[[str, TokenEvent], None], labels: tuple[str, str]
    ) -> None:
        self.sent = sent
        self.model = model
        self._emit = emit
        self._resent = metrics.TOKEN_EVENTS_RESENT.labels(*labels)
        self._listening = False

    def emit_with(self, emit: Callable[[str, TokenEvent], None]) -> None:
        """Queue resent events with `emit` from now on (a worker's next role publishes through its own outbox)."""
        self._emit = emit

    async def start(self, nc: NATS) -> None:
        """Answer the gateways' asks; once a process (a worker's next role keeps the subscription)."""
        if not self._listening:
            await nc.subscribe(resend_subject(self.model), cb=self._asked)
            self._listening = True

    async def run(self, nc: NATS) -> None:
        """After each reconnect, resend what was sent since shortly before the connection was lost; prune now and
        then."""
        clock = self.sent.clock
        reconnects, pruned_at = nc.stats["reconnects"], clock()
        lost_at: float | None = None  # when the connection was first seen lost
        while True:
            await asyncio.sleep(WATCH_S)
            now = clock()
            if not nc.is_connected:
                lost_at = lost_at if lost_at is not None else now
            elif nc.stats["reconnects"] != reconnects:  # (a blip shorter than a tick is seen only here)
                reconnects = nc.stats["reconnects"]
                replays = self.sent.replay_all(since=(lost_at if lost_at is not None else now) - REPLAY_LOOKBACK_S)
                lost_at = None
                count = self._send(replays)
                log.info("reconnected to NATS: sent the token events of %d requests again (%d)", len(replays), count)
            if now - pruned_at >= PRUNE_S:
                self.sent.prune()
                pruned_at = now

    async def _asked(self, msg: Msg) -> None:
        asked = decode_or_drop(msg.data, ResendRequest, msg.subject)
        if asked is None:
            return
        found = [r for item in asked.items if (r := self.sent.replay(item.request_id, item.attempt, item.from_seq))]
        count = self._send(found)
        if count:  # debug: asks come now and then without a loss (pdserve:token_events_resent_total counts)
            log.debug("a gateway lacked token events of %d requests: sent %d again", len(found), count)

    def _send(self, replays: list[tuple[str, list[TokenEvent]]]) -> int:
        count = 0
        for subject, events in replays:
            for event in events:
                self._emit(subject, event)
            count += len(events)
        self._resent.inc(count)
        return count
