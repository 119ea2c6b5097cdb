"""The gateway's pure parts: token-event ordering, worker liveness, text assembly with stop strings,
strict body decoding, and agreement with the engine's sampling rules."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.backend import Update
from services.gateway.decoding import check_content_type, decode_body
from services.gateway.errors import APIError
from services.gateway.liveness import WorkerTable
from services.gateway.ordering import TokenOrder
from services.gateway.prepare import prepare_completion
from services.gateway.request_stream import Deadlines, RequestUpdates
from services.gateway.schemas import CompletionRequest
from services.gateway.served_model import ServedModel
from services.gateway.textstream import TextAssembler
from shared.engine.sampling import SamplingParams
from shared.messages import FailedEvent, FinishedEvent, FinishReason, Heartbeat, TokenEvent, TokensEvent
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings


def ev(
    seq: int, tokens: list[int], attempt: int = 0, finish: str | None = None, error: str | None = None
) -> TokenEvent:
    """Shorthand: tokens, finished ("stop" / "length") or failed ("error" / "abort") by `finish`."""
    if finish in ("error", "abort"):
        return FailedEvent("r1", attempt, error or "", finish_reason=FinishReason(finish))
    if finish is not None:
        return FinishedEvent("r1", attempt, seq, tokens, finish_reason=FinishReason(finish))
    return TokensEvent("r1", attempt, seq, tokens)


def feed(order: TokenOrder, *events: TokenEvent) -> list[Update]:
    return [u for e in events for u in order.push(e)]


# ---- TokenOrder -------------------------------------------------------------------------------------


def test_in_order_events_pass_through():
    order = TokenOrder()
    assert feed(order, ev(0, [10]), ev(1, [11, 12]), ev(3, [13], finish="length")) == [
        Update([10]),
        Update([11, 12]),
        Update([13], "length"),
    ]
    assert order.finished and order.delivered == 4
    assert feed(order, ev(4, [14])) == []  # nothing after the end


def test_duplicates_are_dropped_and_overlaps_trimmed():
    order = TokenOrder()
    assert feed(order, ev(0, [10, 11]), ev(0, [10, 11]), ev(1, [11])) == [Update([10, 11])]
    assert feed(order, ev(1, [11, 12, 13])) == [Update([12, 13])]  # straddles what was delivered
    assert order.delivered == 4


def test_early_events_wait_for_the_gap():
    order = TokenOrder()
    # the decode worker's tokens overtake the prefill worker's first token
    assert feed(order, ev(1, [11]), ev(2, [12]), ev(3, [], finish="stop")) == []
    assert feed(order, ev(0, [10])) == [Update([10]), Update([11]), Update([12]), Update([], "stop")]


def test_stale_attempts_are_dropped():
    order = TokenOrder()
    assert feed(order, ev(0, [10]), ev(1, [11])) == [Update([10]), Update([11])]
    # re-dispatched: attempt 1 recomputes from position 0; only positions not yet delivered go out
    assert feed(order, ev(0, [10], attempt=1)) == []
    assert feed(order, ev(2, [12], attempt=0)) == []  # the old attempt's late event: stale
    assert feed(order, ev(1, [11, 22], attempt=1)) == [Update([22])]
    assert feed(order, ev(3, [33], attempt=0, finish="length")) == []
    assert feed(order, ev(3, [23], attempt=1, finish="length")) == [Update([23], "length")]


def test_new_attempt_discards_early_events_of_the_old_one():
    order = TokenOrder()
    feed(order, ev(0, [10]), ev(2, [12]))  # position 1 of attempt 0 never comes
    assert feed(order, ev(1, [21], attempt=1)) == [Update([21])]
    assert feed(order, ev(2, [22], attempt=1, finish="stop")) == [Update([22], "stop")]


def test_failures_end_the_request_at_once():
    order = TokenOrder()
    feed(order, ev(0, [10]), ev(5, [15]))
    assert feed(order, ev(0, [], finish="error", error="out of blocks")) == [Update([], "error", "out of blocks")]
    assert feed(order, ev(1, [11])) == [] and order.finished
    (update,) = TokenOrder().push(ev(0, [], finish="abort"))
    assert update.failed and update.error  # a default message when the worker gave none


def test_a_failure_of_a_stale_attempt_is_ignored():
    order = TokenOrder()
    feed(order, ev(0, [10], attempt=1))
    assert feed(order, ev(0, [], attempt=0, finish="error", error="old worker died")) == []
    assert feed(order, ev(1, [11], attempt=1, finish="stop")) == [Update([11], "stop")]


# ---- WorkerTable ------------------------------------------------------------------------------------


def beat(worker: str, role: str, model: str = "demo") -> Heartbeat:
    return Heartbeat(worker_id=worker, role=role, model=model, rpc_address=None)


def test_liveness_needs_mixed_or_prefill_and_decode():
    table = WorkerTable(ttl_s=5.0)
    assert table.can_serve("demo", 0.0) == (False, "no live worker serves model 'demo'")
    table.record(beat("p1", "prefill"), now=0.0)
    ok, reason = table.can_serve("demo", 1.0)
    assert not ok and "no live decode worker" in reason and "1 prefill" in reason
    table.record(beat("d1", "decode"), now=1.0)
    assert table.can_serve("demo", 2.0)[0]
    assert not table.can_serve("demo", 5.5)[0]  # p1 went quiet for more than ttl
    table.record(beat("m1", "mixed", model="demo"), now=6.0)
    assert table.can_serve("demo", 6.0) == (True, "live workers for demo: 1 mixed")  # d1 expired too
    assert table.can_serve("other", 6.0)[0] is False


def test_liveness_matches_models_by_subject_token():
    table = WorkerTable()
    table.record(beat("m1", "mixed", model="org/Model-1.5"), now=0.0)
    assert table.can_serve("org_Model-1_5", 0.0)[0] and table.can_serve("org/Model-1.5", 0.0)[0]


# ---- TextAssembler ----------------------------------------------------------------------------------


def run(tokenizer: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], TextAssembler]:
    asm = TextAssembler(tokenizer, stop)
    pieces = [asm.add(t) for t in tokenizer.encode(text)]
    pieces.append(asm.finish())
    return pieces, asm


def test_stop_string_split_across_tokens_never_leaks(tokenizer):
    pieces, asm = run(tokenizer, "say STOP now", ["STOP"])
    assert "".join(pieces) == asm.text == "say " and asm.stopped
    assert all("S" not in p for p in pieces)


def test_held_prefix_is_released_when_it_diverges(tokenizer):
    pieces, asm = run(tokenizer, "ab abc", ["abd"])
    assert pieces[:2] == ["", ""]  # "a", "ab" could start "abd"
    assert "".join(pieces) == "ab abc" and not asm.stopped


def test_earliest_stop_wins_and_multibyte_stop(tokenizer):
    assert run(tokenizer, "x 世界 y z", ["z", "界"])[1].text == "x 世"
    pieces, asm = run(tokenizer, "a🙂b", ["🙂"])
    assert asm.text == "a" and all("\ufffd" not in p for p in pieces)


def test_finish_flushes_held_text_and_cut_characters(tokenizer):
    asm = TextAssembler(tokenizer, ["xyz"])
    ids = tokenizer.encode("ax世")
    assert [asm.add(t) for t in ids[:-1]] == ["a", "", "", ""]  # "x" held (stop prefix), 世 incomplete
    assert asm.finish() == "x\ufffd"


# ---- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": 1}', "prompt"),
        (b'{"prompt": "a", "stop": ["x", 2]}', "stop[1]"),
        (b'{"prompt": "a", "stream_options": {"include_usage": "y"}}', "stream_options.include_usage"),
        (b"{}", "prompt"),
        (b"{", None),
        (b'{"prompt": "\xc3"}', None),
    ],
)
def test_decode_errors_name_the_field(body, param):
    with pytest.raises(APIError) as excinfo:
        decode_body(body, CompletionRequest)
    assert excinfo.value.status == 400 and excinfo.value.param == param


def test_content_types():
    for ok in (None, "application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        check_content_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        with pytest.raises(APIError) as excinfo:
            check_content_type(bad)
        assert excinfo.value.status == 415


# ---- agreement with the engine ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0, "top_p": 1e-6, "top_k": 1, "max_tokens": 1},
        {"temperature": 2.0, "top_p": 1.0, "top_k": -1, "seed": -3},
        {"top_k": 0, "ignore_eos": True, "seed": 2**62},
        {},
    ],
)
def test_what_the_gateway_accepts_the_engine_accepts(checkpoint, fields):
    model = ServedModel.load(GatewaySettings(model=str(checkpoint), model_name="demo"))
    prepared = prepare_completion(CompletionRequest(prompt="hello", **fields), model)
    s = prepared.sampling
    SamplingParams(s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, tuple(s.stop_token_ids), s.ignore_eos)


# ---- RequestUpdates deadlines -------------------------------------------------------------------------


def updates_scenario(deadlines: Deadlines, events: list[TokenEvent]) -> tuple[list[Update], list[str], float]:
    """Push `events` right after opening, read until the end; (updates, cancels, seconds it took)."""

    async def scenario():
        cancels: list[str] = []

        async def cancel(request_id: str) -> None:
            cancels.append(request_id)

        stream = RequestUpdates("r1", deadlines, cancel, forget=lambda _: None)
        for event in events:
            stream.push(event)
        start = time.monotonic()
        updates = [u async for u in stream]
        return updates, cancels, time.monotonic() - start

    return asyncio.run(asyncio.wait_for(scenario(), 10))


def test_first_token_and_progress_deadlines():
    updates, cancels, _ = updates_scenario(Deadlines(0.05, 10.0), [])
    assert updates == [Update([], "error", "no first token within 0.05 s; the request was cancelled", 504)]
    assert cancels == ["r1"]
    updates, cancels, _ = updates_scenario(Deadlines(10.0, 0.05), [ev(0, [1])])
    assert updates[0] == Update([1]) and updates[1].status == 504 and "no progress within 0.05 s" in updates[1].error
    assert cancels == ["r1"]


def test_a_lasting_gap_is_no_deadline():
    """A gap used to fail the request after gap_s (502): its events are asked for again instead (resend_from), and
    only the progress deadline (or a move, why_move) ends a stream that waits on one."""
    events = [ev(0, [1]), ev(2, [3]), ev(3, [4], finish="length")]  # position 1 was lost
    updates, cancels, took = updates_scenario(Deadlines(10.0, 0.5, gap_s=0.05), events)
    assert updates[0] == Update([1])
    assert updates[1].status == 504 and "no progress within 0.5 s" in (updates[1].error or "")
    assert cancels == ["r1"] and took >= 0.5


def test_a_gap_filled_in_time_is_no_failure():
    async def scenario():
        async def never(request_id: str) -> None:
            raise AssertionError(f"{request_id} was cancelled")

        stream = RequestUpdates("r1", Deadlines(10.0, 10.0, gap_s=2.0), cancel=never, forget=lambda _: None)
        stream.push(ev(1, [2], finish="stop"))  # the decode worker overtook the prefill worker
        asyncio.get_running_loop().call_later(0.05, stream.push, ev(0, [1]))
        return [u async for u in stream]

    assert asyncio.run(scenario()) == [Update([1]), Update([2], "stop")]
