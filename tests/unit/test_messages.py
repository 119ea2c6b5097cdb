"""The wire's typed events (one struct per kind, a tagged union): each kind round-trips, decoding refuses fields
that do not fit the kind, and enums travel as their values (the JSON a `nats sub` shows stays readable)."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.messages import (
    FailedEvent,
    FinishedEvent,
    FinishReason,
    Heartbeat,
    QueuedEvent,
    Role,
    TakenEvent,
    TokensEvent,
    decode,
    decode_event,
    decode_event_or_drop,
    encode,
)

EVENTS = [
    TakenEvent("r", 0, 3, "p-1"),
    TokensEvent("r", 1, 0, [5, 6], "d-1", prompt_tokens=4),
    QueuedEvent("r", 0, 1, "p-1"),
    FinishedEvent("r", 0, 7, [9], "d-1", finish_reason=FinishReason.STOP),
    FinishedEvent("r", 0, 8, [], finish_reason=FinishReason.LENGTH),
    FailedEvent("r", 2, "no room", 400, "d-1"),
    FailedEvent("r", 0, "aborted upstream", finish_reason=FinishReason.ABORT),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_each_kind_round_trips(event):
    assert decode_event(encode(event)) == event


def test_enums_travel_as_their_values():
    wire = json.loads(encode(FinishedEvent("r", 0, 1, [2], "w", finish_reason=FinishReason.STOP)))
    assert (wire["kind"], wire["finish_reason"]) == ("finished", "stop")
    beat = Heartbeat(worker_id="w", role=Role.DECODE, model="m", rpc_address=None)
    assert json.loads(encode(beat))["role"] == "decode"
    assert decode(encode(beat), Heartbeat).role is Role.DECODE


def _payload(fields: dict) -> bytes:
    """An event of `fields`' kind with the fields every event of that kind needs, then `fields` (a failure has no
    position, and needs its error)."""
    needed = {"error": "x"} if fields.get("kind") == "failed" else {"seq": 0}
    return json.dumps({"request_id": "r", "attempt": 0, "worker_id": "w"} | needed | fields).encode()


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "taken"},
        {"kind": "queued"},
        {"kind": "tokens", "token_ids": [1]},
        {"kind": "finished", "token_ids": [], "finish_reason": "stop"},
        {"kind": "failed"},
        {"kind": "failed", "finish_reason": "abort", "status": 400},
    ],
)
def test_a_kind_with_its_fields_decodes(fields):
    assert decode_event_or_drop(_payload(fields), "pd.tokens.gw.r") is not None


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "taken", "token_ids": [1]},  # a taker carries no tokens
        {"kind": "queued", "finish_reason": "stop"},
        {"kind": "tokens", "token_ids": []},  # tokens without tokens
        {"kind": "tokens", "token_ids": [1], "finish_reason": "stop"},  # an end must say it is one
        {"kind": "finished", "token_ids": [1]},  # finished without a reason
        {"kind": "finished", "finish_reason": "error"},  # a failure is a failed event
        {"kind": "failed", "finish_reason": "length"},
        {"kind": "failed", "token_ids": [1], "finish_reason": "error"},
        {"kind": "failed", "finish_reason": "error", "status": 200},  # not an error status
        {"kind": "announce"},  # no such kind
        {},  # the kind is never inferred
    ],
)
def test_fields_that_do_not_fit_the_kind_are_malformed(fields):
    payload = _payload(fields)
    with pytest.raises(msgspec.ValidationError):
        decode_event(payload)
    assert decode_event_or_drop(payload, "pd.tokens.gw.r") is None


def test_constructors_refuse_what_decoding_refuses():
    with pytest.raises(ValueError, match="tokens event"):
        TokensEvent("r", 0, 0, [])
    assert isinstance(decode_event(encode(TakenEvent("r", 0, 0, "w"))), TakenEvent)
