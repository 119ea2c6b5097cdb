"""The gateway's side of the resend protocol, as pure state on a fake clock: when a stream asks the workers for
token events again (RequestUpdates.resend_from: a gap, nothing since a reconnect, a silent holder; asked again less
and less often), what a resent event may change (no position twice for the client; an earlier stage's event does
not take the request from the later stage's worker), when a gap moves the request (why_move), and the asks
ResendAsks publishes (one message per RESEND_ITEMS_PER_MESSAGE requests, on the model's resend subject)."""

from __future__ import annotations

import asyncio
from typing import cast

from nats.aio.client import Client as NATS

from services.gateway import request_stream
from services.gateway.request_stream import Deadlines, RequestUpdates
from services.gateway.resend_asks import ResendAsks
from shared.messages import (
    RESEND_ITEMS_PER_MESSAGE,
    FinishedEvent,
    FinishReason,
    QueuedEvent,
    ResendItem,
    ResendRequest,
    TakenEvent,
    TokensEvent,
    decode,
    resend_subject,
)

TTL, STALL, GAP_S = 2.0, 30.0, 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stream(clock: Clock, rid: str = "r") -> RequestUpdates:
    async def cancel(_: str) -> None:
        pass

    return RequestUpdates(rid, Deadlines(60, 60, GAP_S), cancel, lambda _: None, clock=clock)


def tok(seq: int, token: int, worker: str = "d0", finish: bool = False, rid: str = "r"):
    if finish:
        return FinishedEvent(rid, 0, seq, [token], worker, finish_reason=FinishReason.LENGTH)
    return TokensEvent(rid, 0, seq, [token], worker)


def asks_over(s: RequestUpdates, clock: Clock, seconds: float, reconnected_at: float | None = None) -> list[float]:
    """Tick every 0.1 s for `seconds`: when the stream asked (seconds from the start)."""
    start, asked = clock.now, []
    for _ in range(round(seconds / 0.1)):
        clock.now += 0.1
        if s.resend_from(reconnected_at) is not None:
            asked.append(round(clock.now - start, 1))
    return asked


def test_a_gap_is_asked_for_after_a_moment_then_less_and_less_often_until_filled():
    clock = Clock()
    s = stream(clock)
    s.push(tok(0, 10, "p0"))
    s.push(TakenEvent("r", 0, 1, "d0"))
    s.push(tok(1, 11))
    s.push(tok(3, 13))  # position 2 lost
    assert s.resend_from() is None  # the two publishers race by milliseconds: not yet
    clock.now += request_stream.GAP_ASK_S
    assert s.resend_from() == (2, "gap")  # from the first position not delivered
    # asked again 0.5, 1, 2, 4, 8, 8 s after the previous ask (to a tick of the loop)
    asked = [0.0, *asks_over(s, clock, 24.2)]
    intervals = [b - a for a, b in zip(asked, asked[1:], strict=False)]
    wanted = [0.5, 1, 2, 4, 8, 8]
    assert len(intervals) == 6 and all(abs(i - want) < 0.15 for i, want in zip(intervals, wanted, strict=True))
    s.push(tok(2, 12))  # sent again: the gap is filled
    assert s.tokens == [10, 11, 12, 13] and s.resend_from() is None
    s.push(tok(5, 15))  # a new gap starts the count afresh
    clock.now += request_stream.GAP_ASK_S
    assert s.resend_from() == (4, "gap")


def test_after_a_reconnect_every_stream_not_heard_from_since_is_asked_at_once():
    clock = Clock()
    heard, quiet = stream(clock, "a"), stream(clock, "b")
    heard.push(tok(0, 1, rid="a"))
    quiet.push(tok(0, 1, rid="b"))
    clock.now += 0.5
    reconnected = clock.now
    heard.push(tok(1, 2, rid="a"))  # an event after the reconnect: nothing to suspect
    clock.now += 0.1
    assert heard.resend_from(reconnected) is None
    assert quiet.resend_from(reconnected) == (1, "reconnected")
    assert stream(clock, "c").resend_from(reconnected) is None  # opened after it


def test_a_silent_holder_is_asked_and_a_request_waiting_in_a_queue_is_not():
    clock = Clock()
    s = stream(clock)
    s.push(tok(0, 1))
    clock.now += request_stream.SILENT_ASK_S - 0.1
    assert s.resend_from() is None  # a step may take a while
    clock.now += 0.2
    assert s.resend_from() == (1, "silent")  # its FinishedEvent may be what was lost
    queued = stream(clock, "q")
    queued.push(tok(0, 1, "p0", rid="q"))
    queued.push(QueuedEvent("q", 0, 1, "p0"))  # waits in the decode queue: nobody has anything to send
    clock.now += 60
    assert queued.holder is None and queued.resend_from() is None
    routed = stream(clock, "w")
    routed.routed("p1")  # in p1's own queue: a busy worker takes it when it has room
    clock.now += 60
    assert routed.resend_from() is None
    s.push(tok(1, 2, finish=True))
    assert s.finished and s.resend_from() is None


def test_a_resent_token_reaches_the_client_once():
    clock = Clock()
    s = stream(clock)
    for event in (tok(0, 10, "p0"), TakenEvent("r", 0, 1, "d0"), tok(1, 11), tok(2, 12)):
        s.push(event)
    for event in (tok(0, 10, "p0"), tok(1, 11), tok(1, 11), tok(2, 12)):  # everything again, twice over
        s.push(event)
    s.push(FinishedEvent("r", 0, 1, [11, 12, 13], "d0", finish_reason=FinishReason.LENGTH))  # coalesced, resent
    s.push(FinishedEvent("r", 0, 3, [13], "d0", finish_reason=FinishReason.LENGTH))  # the original end, late

    async def read() -> list[tuple[list[int], str | None]]:
        return [(u.token_ids, u.finish_reason) async for u in s]

    assert asyncio.run(read()) == [([10], None), ([11], None), ([12], None), ([13], "length")]


def test_an_earlier_stages_resent_events_leave_the_request_with_the_later_stages_worker():
    """The prefill worker sends its first token, taken and queued events again after the decode worker took the
    request: the decode worker still holds it (its death moves the request; the prefill worker's would not)."""
    clock = Clock()
    s = stream(clock)
    s.push(TakenEvent("r", 0, 1, "d0"))  # the prefill worker's events were lost; the decode worker's came
    s.push(tok(1, 11))
    assert s.holder == "d0"
    s.push(TakenEvent("r", 0, 0, "p0"))
    s.push(tok(0, 10, "p0"))
    s.push(QueuedEvent("r", 0, 1, "p0"))
    assert s.holder == "d0" and s.tokens == [10, 11]
    beats = {"p0": clock.now}
    clock.now += TTL + 0.1  # d0 dies; p0 beats on
    beats["p0"] = clock.now
    assert "d0 sent no heartbeat" in (s.why_move(beats.get, TTL, STALL) or "")


def test_a_gap_nobody_fills_moves_the_request_after_gap_s_of_asking():
    clock = Clock()
    s = stream(clock)
    beats = {"d0": clock.now}
    s.push(TakenEvent("r", 0, 1, "d0"))
    s.push(tok(1, 11))  # position 0 was the prefill worker's, and that worker is gone
    asks_over(s, clock, GAP_S - 0.5)
    beats["d0"] = clock.now
    assert s.why_move(beats.get, TTL, STALL) is None
    asks_over(s, clock, 1.0)
    beats["d0"] = clock.now
    why = s.why_move(beats.get, TTL, STALL)
    assert why is not None and "positions 0-0 never arrived" in why
    # a gap that began while the gateway was away from NATS counts from the reconnect
    s2 = stream(clock, "r2")
    s2.push(TakenEvent("r2", 0, 1, "d0"))
    s2.push(tok(1, 11, rid="r2"))
    clock.now += 60
    reconnected = clock.now
    asks_over(s2, clock, 1.0, reconnected)
    beats["d0"] = clock.now
    assert s2.why_move(beats.get, TTL, STALL, reconnected) is None


class FakeNats:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, payload))


def test_resend_asks_name_every_request_due_in_messages_of_bounded_size():
    clock = Clock()
    streams = {f"r{i}": stream(clock, f"r{i}") for i in range(RESEND_ITEMS_PER_MESSAGE + 5)}
    for rid, s in streams.items():
        s.push(tok(0, 1, rid=rid))
    quiet = stream(clock, "quiet")  # never took: no holder, not silent
    streams["quiet"] = quiet
    asks = ResendAsks("demo", streams.values, clock)
    fake = FakeNats()
    nc = cast(NATS, fake)  # ask() only publishes
    assert asyncio.run(asks.ask(nc)) == 0  # nothing lacking yet
    clock.now += request_stream.SILENT_ASK_S
    assert asyncio.run(asks.ask(nc)) == RESEND_ITEMS_PER_MESSAGE + 5
    assert [subject for subject, _ in fake.published] == [resend_subject("demo")] * 2
    items = [item for _, data in fake.published for item in decode(data, ResendRequest).items]
    assert items[0] == ResendItem("r0", 0, 1) and len(items) == RESEND_ITEMS_PER_MESSAGE + 5
    assert "quiet" not in {i.request_id for i in items}
    assert asyncio.run(asks.ask(nc)) == 0  # asked just now: not again at once
