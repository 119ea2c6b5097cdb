"""The worker's resend buffer (shared/worker/resend.py) as pure state: what it keeps of the token events sent, what
it sends again for a gateway's ask (from a position, in pieces, the end always), what it sends after a reconnect,
and its bounds (in hand: kept; ended: kept for a window, at most so many; cancelled: dropped at once)."""

from __future__ import annotations

import pytest

from services.gateway.ordering import TokenOrder
from shared.messages import (
    Cancel,
    FailedEvent,
    FinishedEvent,
    FinishReason,
    Logprob,
    QueuedEvent,
    TakenEvent,
    TokenEvent,
    TokensEvent,
)
from shared.worker import resend
from shared.worker.resend import SentEvents

SUBJECT = "pd.tokens.g.r"


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def replayed(sent: SentEvents, rid: str, attempt: int, from_seq: int) -> list[TokenEvent]:
    """The events `sent` sends again for an ask (it must have kept the attempt)."""
    kept = sent.replay(rid, attempt, from_seq)
    assert kept is not None, f"{rid} attempt {attempt} not kept"
    return kept[1]


def outputs(events: list[TokenEvent]) -> list[TokensEvent | FinishedEvent]:
    """`events`, each of which must carry output."""
    assert all(isinstance(e, TokensEvent | FinishedEvent) for e in events), events
    return [e for e in events if isinstance(e, TokensEvent | FinishedEvent)]


def decode_stream(sent: SentEvents, tokens: list[int], start: int = 1, finish: bool = True, rid: str = "r") -> None:
    """A decode worker's events for `rid`: taken at `start`, then one token per step, the last finishing it."""
    sent.record(SUBJECT, TakenEvent(rid, 0, start, "d0"))
    for i, token in enumerate(tokens):
        seq = start + i
        if finish and i == len(tokens) - 1:
            sent.record(SUBJECT, FinishedEvent(rid, 0, seq, [token], "d0", finish_reason=FinishReason.LENGTH))
        else:
            sent.record(SUBJECT, TokensEvent(rid, 0, seq, [token], "d0"))


def delivered(events: list[TokenEvent], order: TokenOrder | None = None) -> tuple[list[int], str | None]:
    """What a gateway's ordering hands the client from `events`: token ids and the finish reason."""
    order = order or TokenOrder()
    tokens, reason = [], None
    for event in events:
        for update in order.push(event):
            tokens += update.token_ids
            reason = update.finish_reason or reason
    return tokens, reason


def test_a_stream_is_kept_as_one_run_and_sent_again_from_the_position_asked():
    sent = SentEvents(lambda _: True)
    decode_stream(sent, list(range(100, 110)))
    assert (kept := sent.replay("r", 0, 4)) is not None
    subject, events = kept
    assert subject == SUBJECT
    # one event from position 4 on, the end with it (the taken event at 1 is behind the position asked)
    assert events == [FinishedEvent("r", 0, 4, list(range(103, 110)), "d0", finish_reason=FinishReason.LENGTH)]
    taken, *run = replayed(sent, "r", 0, 0)
    assert taken == TakenEvent("r", 0, 1, "d0")
    assert [(e.seq, e.token_ids) for e in outputs(run)] == [(1, list(range(100, 110)))]
    assert sent.replay("r", 1, 0) is None and sent.replay("other", 0, 0) is None  # nothing of those kept


def test_a_run_not_finished_sends_nothing_past_its_end_and_a_finished_one_its_end_alone():
    sent = SentEvents(lambda _: True)
    decode_stream(sent, [7, 8, 9], finish=False)
    assert replayed(sent, "r", 0, 4) == []  # the gateway has all of it: nothing to send
    sent.record(SUBJECT, FinishedEvent("r", 0, 4, [], "d0", finish_reason=FinishReason.STOP))
    assert replayed(sent, "r", 0, 4) == [FinishedEvent("r", 0, 4, [], "d0", finish_reason=FinishReason.STOP)]


def test_a_long_run_is_sent_in_pieces_with_its_logprobs_and_first_extras(monkeypatch):
    monkeypatch.setattr(resend, "RESEND_TOKENS_PER_EVENT", 4)
    sent = SentEvents(lambda _: True)
    lp = [Logprob(-float(i)) for i in range(10)]
    prompt_lp = [Logprob(-0.5)]
    sent.record(SUBJECT, TokensEvent("r", 0, 0, [0], "m0", 3, lp[:1], prompt_lp, cached_tokens=2))
    for i in range(1, 10):
        sent.record(SUBJECT, TokensEvent("r", 0, i, [i], "m0", 3, lp[i : i + 1]))
    events = outputs(replayed(sent, "r", 0, 0))
    assert [(e.seq, e.token_ids) for e in events] == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]
    assert [lp for e in events for lp in e.logprobs] == lp
    assert events[0].prompt_logprobs == prompt_lp and events[0].cached_tokens == 2  # as first sent
    assert all(not e.prompt_logprobs and not e.cached_tokens for e in events[1:])
    later = outputs(replayed(sent, "r", 0, 5))  # the first position was delivered: its extras were too
    assert later[0].seq == 5 and not later[0].prompt_logprobs and later[0].cached_tokens == 0


def test_a_prefill_workers_first_token_and_hand_on_are_sent_again_in_order():
    sent = SentEvents(lambda _: True)
    taken, token = TakenEvent("r", 0, 0, "p0"), TokensEvent("r", 0, 0, [42], "p0", 3)
    queued = QueuedEvent("r", 0, 1, "p0", routed_to="d1")
    for event in (taken, token, queued):
        sent.record(SUBJECT, event)
    assert replayed(sent, "r", 0, 0) == [taken, token, queued]
    assert replayed(sent, "r", 0, 1) == [queued]  # the token was delivered


def test_a_failure_is_always_sent_again():
    sent = SentEvents(lambda _: True)
    sent.record(SUBJECT, TakenEvent("r", 0, 0, "p0"))
    sent.record(SUBJECT, FailedEvent("r", 0, "too long", 400, "p0"))
    assert replayed(sent, "r", 0, 5) == [FailedEvent("r", 0, "too long", 400, "p0")]


def test_attempts_are_kept_apart_and_a_new_worker_starts_a_new_run():
    sent = SentEvents(lambda _: True)
    decode_stream(sent, [1, 2, 3], finish=False)
    sent.record(SUBJECT, TokensEvent("r", 1, 3, [4], "d1"))  # the request moved: attempt 1, another worker
    assert replayed(sent, "r", 1, 0) == [TokensEvent("r", 1, 3, [4], "d1")]
    taken, run = replayed(sent, "r", 0, 0)
    assert isinstance(taken, TakenEvent) and [e.seq for e in outputs([run])] == [1]
    sent.forget(Cancel("r", up_to_attempt=0))  # the move's cancel: attempt 0 only
    assert sent.replay("r", 0, 0) is None and sent.replay("r", 1, 0) is not None
    sent.forget(Cancel("r"))  # the client went away: every attempt
    assert len(sent) == 0


def test_replay_all_sends_every_attempt_that_sent_since_from_its_first_event():
    clock = Clock()
    sent = SentEvents(lambda _: True, clock=clock)
    decode_stream(sent, [1, 2], rid="a")
    clock.now += 10
    decode_stream(sent, [3], finish=False, rid="b")
    replays = sent.replay_all()
    assert [[type(e).__name__ for e in events] for _, events in replays] == [
        ["TakenEvent", "FinishedEvent"],
        ["TakenEvent", "TokensEvent"],
    ]
    # after a reconnect: only what sent anything since shortly before the connection was lost (a finished long
    # before reached the gateway while the server was up)
    assert [[e.request_id for e in events][0] for _, events in sent.replay_all(since=clock.now - 5)] == ["b"]


def test_in_hand_attempts_stay_and_ended_ones_go_after_the_window_or_past_the_cap():
    clock = Clock()
    in_hand = {"live"}
    sent = SentEvents(lambda key: key in in_hand, keep_s=10.0, max_ended=2, clock=clock)
    for rid in ("live", "e1", "e2", "e3"):  # sent at 50, 51, 52, 53
        decode_stream(sent, [1, 2], rid=rid)
        clock.now += 1.0
    sent.prune()
    assert sent.replay("e1", 0, 0) is None  # the oldest ended one past max_ended
    assert all(sent.replay(rid, 0, 0) is not None for rid in ("live", "e2", "e3"))
    clock.now = 62.5
    sent.prune()
    assert sent.replay("e2", 0, 0) is None and sent.replay("e3", 0, 0) is not None  # 10.5 s and 9.5 s after
    clock.now += 1.0
    sent.prune()
    assert sent.replay("e3", 0, 0) is None
    clock.now += 1000.0
    sent.prune()
    assert sent.replay("live", 0, 0) is not None  # in hand: kept however long it is silent
    in_hand.clear()
    sent.prune()
    assert len(sent) == 0


@pytest.mark.parametrize("lost", [[0], [3, 4, 5], [9], [0, 9], list(range(10))])
def test_events_lost_and_sent_again_reach_the_client_once_each(lost):
    """The gateway's side of the promise: whatever subset of a stream's events was lost, the resent events fill
    it, and everything that arrives twice (resent positions it had, resent ends) is dropped: each position once."""
    sent = SentEvents(lambda _: True)
    sent.record(SUBJECT, TokensEvent("r", 0, 0, [100], "p0"))  # the prefill worker's first token
    decode_stream(sent, list(range(101, 110)))  # the decode worker's, finishing at 9
    original = [TokensEvent("r", 0, 0, [100], "p0"), TakenEvent("r", 0, 1, "d0")] + [
        FinishedEvent("r", 0, s, [100 + s], "d0", finish_reason=FinishReason.LENGTH)
        if s == 9
        else TokensEvent("r", 0, s, [100 + s], "d0")
        for s in range(1, 10)
    ]
    order = TokenOrder()
    arrived = [e for e in original if not (isinstance(e, TokensEvent | FinishedEvent) and e.seq in lost)]
    first, _ = delivered(arrived, order)
    assert first == list(range(100, 100 + min(lost)))  # delivered up to the first lost position
    again = replayed(sent, "r", 0, order.delivered)
    twice = replayed(sent, "r", 0, 0)  # everything, as after a reconnect: all of it a duplicate now
    rest, reason = delivered(again + twice, order)
    assert first + rest == list(range(100, 110)) and reason == "length"
