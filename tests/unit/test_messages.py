"""The wire's typed events: each kind round-trips, decoding refuses fields that do not fit the kind, and enums
travel as their values (the JSON a `nats sub` shows stays readable)."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.messages import (
    EventKind,
    FinishReason,
    Heartbeat,
    Role,
    TokenEvent,
    decode,
    decode_or_drop,
    encode,
)

EVENTS = [
    TokenEvent.taken("r", 0, 3, "p-1"),
    TokenEvent.tokens("r", 1, 0, [5, 6], "d-1", prompt_tokens=4),
    TokenEvent.queued("r", 0, 1, "p-1"),
    TokenEvent.finished("r", 0, 7, [9], FinishReason.STOP, "d-1"),
    TokenEvent.finished("r", 0, 8, [], FinishReason.LENGTH),
    TokenEvent.failed("r", 2, "no room", 400, "d-1"),
    TokenEvent.failed("r", 0, "aborted upstream", reason=FinishReason.ABORT),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{e.kind}")
def test_each_kind_round_trips(event):
    assert decode(encode(event), TokenEvent) == event


def test_enums_travel_as_their_values():
    wire = json.loads(encode(TokenEvent.finished("r", 0, 1, [2], FinishReason.STOP, "w")))
    assert (wire["kind"], wire["finish_reason"]) == ("finished", "stop")
    beat = Heartbeat(worker_id="w", role=Role.DECODE, model="m", rpc_address=None)
    assert json.loads(encode(beat))["role"] == "decode"
    assert decode(encode(beat), Heartbeat).role is Role.DECODE


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
    payload = json.dumps({"request_id": "r", "attempt": 0, "seq": 0} | fields).encode()
    with pytest.raises(msgspec.ValidationError):
        decode(payload, TokenEvent)
    assert decode_or_drop(payload, TokenEvent, "pd.tokens.gw.r") is None


def test_constructors_refuse_what_decoding_refuses():
    with pytest.raises(ValueError, match="tokens event"):
        TokenEvent.tokens("r", 0, 0, [])
    assert TokenEvent.taken("r", 0, 0, "w").kind is EventKind.TAKEN
