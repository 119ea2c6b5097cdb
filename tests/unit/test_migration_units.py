"""Moving a request between workers, as pure state: who holds it (from the token events), when it must move
(holder dead or stalled), and what the client sees across the move (no position twice, none missing).
The real thing, with processes killed, is tests/test_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.ordering import TokenOrder
from services.gateway.request_stream import Deadlines, RequestUpdates
from shared.messages import (
    Cancel,
    FinishedEvent,
    FinishReason,
    PrefillJob,
    QueuedEvent,
    Sampling,
    TakenEvent,
    TokenEvent,
    TokensEvent,
    attempt_key,
)

TTL, STALL = 2.0, 10.0


def ev(seq, tokens, worker="", attempt=0, finish=None, queued=False) -> TokenEvent:
    """Shorthand: queued, taken (no tokens), tokens or finished (`finish`) by its arguments."""
    if queued:
        return QueuedEvent("r", attempt, seq, worker)
    if finish is not None:
        return FinishedEvent("r", attempt, seq, tokens, worker, finish_reason=FinishReason(finish))
    if not tokens:
        return TakenEvent("r", attempt, seq, worker)
    return TokensEvent("r", attempt, seq, tokens, worker)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def updates(clock: Clock) -> RequestUpdates:
    async def cancel(_: str) -> None:
        pass

    job = PrefillJob("r", "m", [1, 2, 3], Sampling(max_tokens=8), "pd.tokens.g.r")
    return RequestUpdates("r", Deadlines(60, 60), cancel, lambda _: None, clock=clock, job=job)


def test_move_on_makes_the_old_attempt_stale_and_keeps_delivered_tokens():
    order = TokenOrder()
    assert [u.token_ids for u in order.push(ev(0, [7]))] == [[7]]
    assert [u.token_ids for u in order.push(ev(1, [8, 9]))] == [[8, 9]]
    order.push(ev(5, [1]))  # early, never to be filled by the old attempt
    order.move_on(1)
    assert order.gap() is None
    assert order.push(ev(3, [4], attempt=0)) == []  # the old worker woke up: stale
    # the new attempt resumes at position 3 (a recompute may repeat earlier positions: dropped)
    got = order.push(ev(2, [9, 10, 11], attempt=1))
    assert [u.token_ids for u in got] == [[10, 11]]
    assert order.tokens == [7, 8, 9, 10, 11] and order.delivered == 5
    with pytest.raises(ValueError):
        order.move_on(1)


def test_holder_follows_the_events_of_the_current_attempt():
    clock = Clock()
    s = updates(clock)
    assert s.holder is None  # queued for prefill
    s.push(ev(0, [], worker="p0"))  # p0 took it
    assert s.holder == "p0"
    s.push(ev(0, [5], worker="p0"))
    s.push(ev(1, [], worker="d0"))  # the decode worker took it before p0's queued event arrived
    s.push(ev(1, [], worker="p0", queued=True))  # p0 handing off does not unseat d0
    assert s.holder == "d0"
    s2 = updates(clock)
    s2.push(ev(0, [5], worker="p0"))
    s2.push(ev(1, [], worker="p0", queued=True))
    assert s2.holder is None  # waiting in the decode queue: nobody to watch
    s.move_on()
    assert s.holder is None and s.attempt == 1 and s.migrations == 1
    s.push(ev(1, [6], worker="d0", attempt=0))  # stale: does not make d0 the holder again
    assert s.holder is None


def test_why_move_judges_the_holder_by_heartbeat_then_by_stall():
    clock = Clock()
    s = updates(clock)
    beats: dict[str, float] = {}
    assert s.why_move(beats.get, TTL, STALL) is None  # nobody holds it
    s.push(ev(0, [], worker="p0"))
    clock.now += TTL - 0.1
    assert s.why_move(beats.get, TTL, STALL) is None  # never heard from, but only just took it
    clock.now += 0.2
    assert "p0 sent no heartbeat" in s.why_move(beats.get, TTL, STALL)
    beats["p0"] = clock.now
    clock.now += 30  # a long prefill with heartbeats flowing is no stall (no token in this attempt yet)
    beats["p0"] = clock.now
    assert s.why_move(beats.get, TTL, STALL) is None
    s.push(ev(0, [5], worker="p0"))
    s.push(ev(1, [6], worker="d0"))
    beats["d0"] = clock.now
    clock.now += STALL + 1
    beats["d0"] = clock.now
    assert "d0 produced no token" in s.why_move(beats.get, TTL, STALL)
    s.push(ev(2, [7], worker="d0", finish="length"))
    assert s.why_move(beats.get, TTL, STALL) is None  # finished: nothing to move


def test_a_job_routed_to_a_worker_is_held_by_it_until_taken_and_moves_when_it_dies():
    clock = Clock()
    s = updates(clock)
    beats = {"p1": clock.now, "p2": clock.now}
    s.routed("p1")  # published to p1's own queue: nobody else would take it
    assert s.holder == "p1" and s.queued_for == "p1"
    clock.now += TTL + 0.1  # p1 died before taking it
    assert "p1 sent no heartbeat" in s.why_move(beats.get, TTL, STALL)
    s.move_on()
    assert s.holder is None and s.queued_for is None  # the next attempt waits in the shared queue
    s2 = updates(clock)
    s2.routed("p1")
    s2.push(ev(0, [], worker="p2"))  # handed back by a draining p1: p2 took it
    assert s2.holder == "p2" and s2.queued_for is None


def test_a_decode_job_routed_to_a_decode_worker_is_held_by_it_while_it_waits_there():
    """The prefill worker's QueuedEvent names the decode worker whose own queue got the decode job (decode-side
    reuse): that worker holds the request; waiting there long is no stall (a busy worker takes it when it has
    room), its death moves the request, and its TakenEvent ends the wait."""
    clock = Clock()
    s = updates(clock)
    beats = {"p1": clock.now, "d1": clock.now}
    s.push(ev(0, [5], worker="p1"))
    s.push(QueuedEvent("r", 0, 1, "p1", routed_to="d1"))
    assert s.holder == "d1" and s.queued_for == "d1"
    clock.now += STALL + 1
    beats["d1"] = clock.now
    assert s.why_move(beats.get, TTL, STALL) is None  # alive, busy: not a stall
    clock.now += TTL + 0.1  # and then dead with the job in its own queue
    assert "d1 sent no heartbeat" in s.why_move(beats.get, TTL, STALL)
    s2 = updates(clock)
    beats["d2"] = clock.now
    s2.push(ev(0, [5], worker="p1"))
    s2.push(QueuedEvent("r", 0, 1, "p1", routed_to="d2"))
    s2.push(ev(1, [], worker="d2"))
    assert s2.holder == "d2" and s2.queued_for is None  # taken: tokens judge it from now
    s3 = updates(clock)
    s3.push(ev(0, [5], worker="p1"))
    s3.push(ev(1, [], worker="d2"))  # the decode worker spoke before the prefill worker's QueuedEvent came in
    s3.push(QueuedEvent("r", 0, 1, "p1", routed_to="d2"))
    assert s3.holder == "d2" and s3.queued_for is None
    s4 = updates(clock)
    s4.push(ev(0, [5], worker="p1"))
    s4.push(ev(1, [], worker="p1", queued=True))  # to the shared queue: nobody holds it
    assert s4.holder is None


def test_a_stream_silent_since_nats_came_back_is_asked_for_its_events_not_moved():
    """Token events sent while NATS was away are lost; the holder has them and sends them again when asked. Until
    its heartbeat stops, the request stays with it (it used to move worker_ttl_s after the reconnect)."""
    clock = Clock()
    s = updates(clock)
    beats = {"d0": clock.now}
    s.push(ev(0, [5], worker="d0"))
    clock.now += 1.0
    reconnected = clock.now  # NATS was away; d0's events meanwhile were lost
    clock.now += 0.1
    assert s.resend_from(reconnected) == (1, "reconnected")
    clock.now += TTL + STALL / 2
    beats["d0"] = clock.now
    assert s.why_move(beats.get, TTL, STALL, reconnected) is None  # alive: asked again, not moved
    s.push(ev(1, [6], worker="d0"))  # sent again
    assert s.resend_from(reconnected) is None and s.tokens == [5, 6]
    clock.now += TTL + 0.1
    assert "d0 sent no heartbeat" in (s.why_move(beats.get, TTL, STALL, reconnected) or "")  # really gone: it moves


def test_client_sees_every_position_once_across_a_move():
    clock = Clock()
    s = updates(clock)

    async def drain() -> list[int]:
        tokens = []
        async for u in s:
            tokens += u.token_ids
        return tokens

    s.push(ev(0, [10], worker="p0"))
    s.push(ev(1, [11, 12], worker="d0"))
    assert s.tokens == [10, 11, 12]
    s.move_on()  # d0 died
    s.push(ev(2, [12, 13], worker="d1", attempt=1))  # overlaps position 2
    s.push(ev(3, [99], worker="d0", attempt=0))  # d0 was only hung: stale
    s.push(ev(4, [14], worker="d1", attempt=1, finish="length"))
    assert asyncio.run(drain()) == [10, 11, 12, 13, 14]


def test_a_second_taker_of_the_same_stage_is_ignored():
    """A job redelivered while its first taker was hung: the first to announce keeps the stage, the other's
    events are dropped (two differently sampled continuations must never interleave)."""
    s = updates(Clock())
    s.push(ev(0, [], worker="p0"))
    s.push(ev(0, [5], worker="p0"))
    s.push(ev(1, [], worker="d1"))  # d1 took the decode job (redelivered after d0 hung holding it)
    s.push(ev(1, [], worker="d0"))  # d0 woke up and announced it too
    s.push(ev(1, [66, 67], worker="d0"))
    assert s.holder == "d1" and s.delivered == 1
    s.push(ev(1, [6, 7], worker="d1", finish="length"))
    assert s.tokens == [5, 6, 7]


def test_a_request_given_up_is_watched_no_more():
    clock = Clock()
    s = updates(clock)
    s.push(ev(0, [], worker="p0"))
    clock.now += TTL + 1
    assert s.why_move({}.get, TTL, STALL) is not None
    s.give_up("moved too often", 502)
    assert s.why_move({}.get, TTL, STALL) is None  # not reported again before the client reads the failure
    update = asyncio.run(anext(s))
    assert update.failed and update.status == 502 and update.error == "moved too often"


def test_cancel_covers_attempts_up_to_its_own():
    assert Cancel("r").covers(7)
    assert Cancel("r", up_to_attempt=1).covers(1) and not Cancel("r", up_to_attempt=1).covers(2)
    assert attempt_key("r", 0) == "r" and attempt_key("r", 2) == "r~2"
