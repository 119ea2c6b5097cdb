"""`pdserve bench`: metric arithmetic against hand-computed values, the workloads, the arrival process, the SSE
client against fake servers (in-memory and over a real socket, for timing), and one run against a real stack."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from services.bench.arrivals import arrival_offsets
from services.bench.cli import main as bench_main
from services.bench.cli import parse_goodput, parse_percentiles
from services.bench.client import request_body, send
from services.bench.datasets import BenchRequest, interference_requests, random_requests, sharegpt_requests
from services.bench.metrics import RequestRecord, summarize
from services.bench.prompts import PromptMaker
from services.bench.report import format_table
from services.bench.runner import BenchConfig, schedule
from services.demo_model import write_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.model.tokenizer import Tokenizer

VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p50", "p90",
                                                                             "p99")]  # fmt: skip
RESULT_KEYS = ["date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("bench") / "m", arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


class CharTokenizer:
    """One token per character (code points 32..126): cheap, for workloads with thousands of requests."""

    vocab_size = 127

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


# ---------------------------------------------------------------------------------------------------- metrics


def _records() -> list[RequestRecord]:
    """Three successes and a failure with binary-exact times (s):
    r1: TTFT 0.125, 8 gaps of 0.125, 9 tokens, E2EL 1.125 → TPOT 0.125
    r2: TTFT 0.25, 4 gaps of 0.5, 5 tokens, E2EL 2.25 → TPOT 0.5
    r3: TTFT 0.375, 1 token, E2EL 0.375 → no TPOT (0 for goodput)"""
    return [
        RequestRecord("a", 10, 9, 0.0, True, ttft_s=0.125, itl_s=[0.125] * 8, latency_s=1.125, output_tokens=9),
        RequestRecord("b", 20, 5, 0.5, True, ttft_s=0.25, itl_s=[0.5] * 4, latency_s=2.25, output_tokens=5),
        RequestRecord("a", 30, 1, 1.0, True, ttft_s=0.375, latency_s=0.375, output_tokens=1),
        RequestRecord("b", 100, 7, 0.25, False, error="HTTP 500: boom", ttft_s=9.0, latency_s=9.0, output_tokens=3),
    ]


def test_summary_matches_hand_computed_values():
    s = summarize(_records(), duration_s=2.0)
    assert all(k in s for k in VLLM_KEYS)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 15)  # the failure counts nowhere else
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 7.5 and s["total_token_throughput"] == 37.5
    assert s["request_goodput"] is None  # no SLO given: vLLM writes null
    expected = {
        # TTFT ms [125, 250, 375]; p90 = 250 + 0.8·125 (linear between the 2nd and 3rd), p99 = 250 + 0.98·125
        "ttft": (250, 250, 125 * math.sqrt(2 / 3), 250, 350, 372.5),
        # TPOT ms [125, 500]: r3 (one token) excluded
        "tpot": (312.5, 312.5, 187.5, 312.5, 125 + 0.9 * 375, 125 + 0.99 * 375),
        # ITL pooled: 8 × 125 and 4 × 500
        "itl": (250, 125, statistics.pstdev([125] * 8 + [500] * 4), 125, 500, 500),
        # E2EL ms sorted [375, 1125, 2250]
        "e2el": (1250, 1125, statistics.pstdev([375, 1125, 2250]), 1125, 1125 + 0.8 * 1125, 1125 + 0.98 * 1125),
    }
    for m, (mean, median, std, p50, p90, p99) in expected.items():
        got = [s[f"{k}_{m}_ms"] for k in ("mean", "median", "std", "p50", "p90", "p99")]
        assert got == pytest.approx([mean, median, std, p50, p90, p99]), m
    # Token times (s from the first send): r1 at 0.125·k (k=1..9), r2 at 0.75 + 0.5·k (k=0..4), r3 at 1.375;
    # second 0 holds 7 + 1 of them. All three are in flight at t = 1.0.
    assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == (8.0, 3)
    assert "per_kind" in s


def test_percentile_keys_follow_vllm_naming():
    s = summarize(_records(), 2.0, percentiles=(70, 99.9))
    assert s["p70_itl_ms"] == pytest.approx(125 + 0.7 * 375)  # index 7.7 of the sorted 12
    assert "p99.9_ttft_ms" in s and "p90_ttft_ms" not in s


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 300}, 2),  # r1, r2; r3's TTFT is 375
        ({"tpot": 200}, 2),  # r1 and r3 (one token: TPOT 0); r2's is 500
        ({"ttft": 300, "tpot": 200}, 1),  # r2 meets TTFT only, r3 TPOT only: neither counts
        ({"e2el": 1200, "ttft": 400}, 2),  # r1, r3
        ({"ttft": 375}, 3),  # the limit itself meets the SLO
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    assert summarize(_records(), 2.0, slos)["request_goodput"] == good / 2.0


def test_per_kind_split():
    s = summarize(_records(), 2.0, {"ttft": 300})
    a, b = s["per_kind"]["a"], s["per_kind"]["b"]
    assert (a["completed"], a["failed"], b["completed"], b["failed"]) == (2, 0, 1, 1)
    assert a["mean_ttft_ms"] == 250 and b["mean_ttft_ms"] == 250 and a["mean_tpot_ms"] == 125
    assert a["request_goodput"] == 0.5 and b["request_goodput"] == 0.5
    assert all(k in a for k in VLLM_KEYS)
    assert "per_kind" not in summarize([r for r in _records() if r.kind == "a"], 2.0)


def test_summary_of_only_failures_reports_zeros():
    s = summarize([_records()[3]], 1.0, {"ttft": 100})
    assert (s["completed"], s["failed"], s["request_goodput"], s["p99_ttft_ms"]) == (0, 1, 0.0, 0.0)


@pytest.mark.parametrize("slos", [{"ttfb": 1}, {"ttft": 0}, {"ttft": -5}, {"tpot": float("inf")}])
def test_bad_slos_are_refused(slos):
    with pytest.raises(ValueError):
        summarize(_records(), 1.0, slos)


def test_table_prints_like_vllm_with_a_line_per_kind():
    summary = {"max_concurrency": None, "request_rate": 2.0} | summarize(_records(), 2.0, {"ttft": 300})
    table = format_table(summary, (50, 99), ("ttft", "tpot"))
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    rows = {line[:40].strip(): line[41:] for line in lines}
    assert rows["Successful requests:"] == "3" and rows["Request goodput (req/s):"] == "1.00"
    assert rows["Request rate configured (RPS):"] == "2.00" and rows["P99 TTFT (ms):"] == "372.50"
    assert "Inter-token Latency" not in table  # not among the metrics asked for
    kinds = [line.split()[:3] for line in lines if line.startswith(("a ", "b "))]
    assert kinds == [["a", "2", "0"], ["b", "1", "1"]]


def test_cli_parsers():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_percentiles("50, 90,99.9") == (50, 90, 99.9)
    for bad in (["ttft"], ["ttft:abc"], ["itl:5"], ["e2el:-1"], ["ttft:5:6"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    for bad in ("", "50,abc", "101"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


# ---------------------------------------------------------------------------------------------------- datasets


def test_random_lengths_cover_the_range_and_prompt_len_is_the_real_count(tok):
    reqs = random_requests(tok, 400, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and min(outs) >= 10 and max(outs) <= 30
    assert min(ins) <= 22 and max(ins) >= 58 and len(set(outs)) == 21  # uniform: the whole range shows up
    assert all(len(tok.encode(r.prompt)) == r.prompt_len for r in reqs)
    assert all(c.isprintable() or c in " \t\n" for r in reqs for c in r.prompt)  # no U+FFFD or control chars
    assert reqs == random_requests(tok, 400, 40, 20, 0.5, seed=3)  # seeded
    assert reqs != random_requests(tok, 400, 40, 20, 0.5, seed=4)


def test_random_with_zero_range_ratio_is_fixed(tok):
    reqs = random_requests(tok, 50, input_len=33, output_len=7, seed=1, kind="x")
    assert {(r.prompt_len, r.output_len, r.kind, r.at_s) for r in reqs} == {(33, 7, "x", None)}
    assert len({r.prompt for r in reqs}) == 50
    with pytest.raises(ValueError):
        random_requests(tok, 5, 10, 10, range_ratio=1.0)


def test_random_prompts_with_a_merging_bpe_hit_the_target():
    """A BPE with merges re-encodes decoded random ids to fewer tokens; the builder adjusts (±1 at worst)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "prefill and decode, disaggregated"] * 50
    trainer = trainers.BpeTrainer(vocab_size=350, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    hf.train_from_iterator(corpus, trainer)

    class Wrapped:
        vocab_size = hf.get_vocab_size()
        encode = staticmethod(lambda text: hf.encode(text).ids)
        decode = staticmethod(lambda ids: hf.decode(ids))

    maker, rng = PromptMaker(Wrapped()), np.random.default_rng(0)
    for target in range(1, 200, 7):
        text, count = maker.make(target, rng)
        assert count == len(hf.encode(text).ids) and abs(count - target) <= 1


def _write_sharegpt(path, entries) -> str:
    path.write_text(json.dumps(entries))
    return str(path)


def _conv(i, *turns):
    return {"id": str(i), "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_filters_and_lengths(tmp_path, tok):
    ok = "tell me about disaggregation"
    entries = [
        _conv(0, ("human", ok), ("gpt", "prefill and decode run apart")),
        _conv(1, ("human", "only one turn here")),  # fewer than 2 turns
        _conv(2, ("human", "hi"), ("gpt", "a long enough answer")),  # prompt under 4 tokens
        _conv(3, ("human", "x" * 60), ("gpt", "a long enough answer")),  # prompt over max_input_len=50
        _conv(4, ("human", "a question long enough"), ("gpt", "ok")),  # reply under 4 tokens
        _conv(5, ("system", "be nice"), ("human", "the system turn is skipped"), ("gpt", "answer here")),
        _conv(6, ("gpt", "starts with the model"), ("human", "and never gets an answer")),
        _conv(7, ("human", "reply too long for max_output_len"), ("gpt", "y" * 40)),
    ]
    path = _write_sharegpt(tmp_path / "sg.json", entries)
    reqs = sharegpt_requests(path, tok, num=2, seed=0, max_input_len=50, max_output_len=30)
    assert {r.prompt for r in reqs} == {ok, "the system turn is skipped"}
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt[ok].prompt_len == len(tok.encode(ok))
    assert by_prompt[ok].output_len == len(tok.encode("prefill and decode run apart"))
    # output_len given: the reply's length no longer matters, so entry 4 ("ok") passes too
    fixed = sharegpt_requests(path, tok, num=3, seed=0, output_len=12, max_input_len=50, max_output_len=30)
    assert {r.prompt for r in fixed} == {ok, "the system turn is skipped", "a question long enough"}
    assert {r.output_len for r in fixed} == {12}
    # more than pass: drawn again to make the number; the same seed gives the same list
    many = sharegpt_requests(path, tok, num=7, seed=4, max_input_len=50, max_output_len=30)
    assert len(many) == 7 and {r.prompt for r in many} == {ok, "the system turn is skipped"}
    assert many == sharegpt_requests(path, tok, num=7, seed=4, max_input_len=50, max_output_len=30)


@pytest.mark.parametrize(
    "content",
    ['{"conversations": []}', '["a", "b"]', "[]", '[{"id": 1, "messages": []}]', "not json at all"],
)
def test_sharegpt_refuses_other_formats(tmp_path, tok, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="ShareGPT|conversations"):
        sharegpt_requests(path, tok, num=1)


def test_sharegpt_with_nothing_usable_is_an_error(tmp_path, tok):
    path = _write_sharegpt(tmp_path / "sg.json", [_conv(0, ("human", "hi"), ("gpt", "hello there"))])
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_requests(path, tok, num=1)


def test_interference_kinds_and_times(tok):
    reqs = interference_requests(tok, duration_s=20, stream_rate=2, stream_input_len=16, stream_output_len=8,
                                 long_interval_s=6, long_input_len=96, long_output_len=2, seed=1)  # fmt: skip
    times = [r.at_s for r in reqs]
    assert times == sorted(times) and all(0 <= t < 20 for t in times)
    longs = [r for r in reqs if r.kind == "long"]
    assert [r.at_s for r in longs] == [3, 9, 15]
    assert {(r.prompt_len, r.output_len) for r in longs} == {(96, 2)}
    streams = [r for r in reqs if r.kind == "stream"]
    assert {(r.prompt_len, r.output_len) for r in streams} == {(16, 8)} and len(streams) > 10
    assert {r.kind for r in reqs} == {"stream", "long"}


def _intervals(burstiness: float) -> np.ndarray:
    reqs = interference_requests(CharTokenizer(), duration_s=4000, stream_rate=5, stream_input_len=2,
                                 stream_output_len=1, long_interval_s=1000, long_input_len=2, long_output_len=1,
                                 seed=7, burstiness=burstiness)  # fmt: skip
    return np.diff([r.at_s for r in reqs if r.kind == "stream"])


def test_interference_stream_arrivals_follow_the_rate_and_burstiness():
    poisson = _intervals(1.0)
    # about 20000 arrivals, Poisson: sd ≈ 141; 5 sd
    assert abs(len(poisson) + 1 - 20_000) < 700
    cv = {b: np.std(iv) / np.mean(iv) for b, iv in ((0.25, _intervals(0.25)), (1.0, poisson), (4.0, _intervals(4.0)))}
    assert cv[1.0] == pytest.approx(1.0, abs=0.05)
    assert cv[0.25] == pytest.approx(2.0, rel=0.1) and cv[4.0] == pytest.approx(0.5, rel=0.1)


# ---------------------------------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_gamma_intervals_have_mean_one_over_rate(burstiness):
    times = arrival_offsets(20_000, rate=4.0, burstiness=burstiness, seed=0)
    gaps = np.diff([0.0, *times])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_and_inf_is_all_at_once():
    assert arrival_offsets(50, 3.0, seed=1) == arrival_offsets(50, 3.0, seed=1)
    assert arrival_offsets(50, 3.0, seed=1) != arrival_offsets(50, 3.0, seed=2)
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    assert arrival_offsets(3, 2.0, burstiness=float("inf")) == [0.5, 1.0, 1.5]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_schedule_keeps_fixed_times_and_fills_the_rest_from_the_process():
    reqs = [BenchRequest("p", 1, 1, at_s=5.0), BenchRequest("p", 1, 1), BenchRequest("p", 1, 1)]
    assert schedule(reqs, 2.0, 1.0, seed=3) == [5.0, *arrival_offsets(2, 2.0, 1.0, seed=3)]


# ---------------------------------------------------------------------------------------------------- client


def _sse(*events: str, sep: str = "\n\n") -> bytes:
    return "".join(f"data: {e}{sep}" for e in events).encode()


def _chunk(text: str) -> str:
    return json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text}]})


USAGE = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 3}})


def _send_mock(handler, req=None, endpoint="completions", base_url="http://test/v1", api_key=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(http, base_url, "m", endpoint, req or BenchRequest("hello", 5, 3), api_key,
                              time.perf_counter())  # fmt: skip

    return asyncio.run(go())


def test_client_parses_a_stream_and_counts_usage():
    seen = {}

    def handler(request: httpx.Request):
        seen["url"], seen["body"], seen["auth"] = str(request.url), json.loads(request.content), request.headers
        return httpx.Response(200, content=_sse(_chunk("a"), _chunk(""), _chunk("c"), USAGE, "[DONE]"))

    rec = _send_mock(handler, api_key="k")
    assert rec.success and rec.error == ""
    assert rec.output_tokens == 3 and rec.prompt_len == 42  # the server's usage wins
    assert len(rec.itl_s) == 2  # the empty-text chunk is a token (half a character, say); usage is not
    assert 0 < rec.ttft_s <= rec.latency_s
    assert seen["url"] == "http://test/v1/completions"
    assert seen["auth"]["authorization"] == "Bearer k" and seen["auth"]["x-request-id"].startswith("bench-")
    body = seen["body"]
    assert body["prompt"] == "hello" and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0


def test_client_chat_body_and_no_usage_counts_chunks():
    chat = [json.dumps({"choices": [{"delta": {"role": "assistant", "content": "x"}}]}),
            json.dumps({"choices": [{"delta": {"content": "y"}, "finish_reason": "length"}]})]  # fmt: skip
    seen = {}

    def handler(request: httpx.Request):
        seen["url"], seen["body"] = str(request.url), json.loads(request.content)
        return httpx.Response(200, content=_sse(*chat, "[DONE]", sep="\r\n\r\n"))  # CRLF separators parse too

    rec = _send_mock(handler, endpoint="chat", base_url="http://test/")
    assert rec.success and rec.output_tokens == 2 and rec.prompt_len == 5
    assert seen["url"] == "http://test/v1/chat/completions"
    assert seen["body"]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen["body"]["max_completion_tokens"] == 3
    assert request_body("m", "chat", BenchRequest("q", 1, 2), {"max_tokens": 2, "temperature": 1})["temperature"] == 1


def test_client_tolerates_comments_fields_and_multiline_data():
    raw = (": keep-alive\n\nevent: message\nid: 1\ndata: " + _chunk("a") + "\n\n"
           + 'data: {"choices": [{"text":\ndata: "b"}]}\n\n' + "data: " + _chunk("c") + "\ndata: [DONE]\n")  # fmt: skip
    rec = _send_mock(lambda request: httpx.Response(200, content=raw.encode()))
    assert rec.success and rec.output_tokens == 3


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(200, content=_sse(_chunk("a"), json.dumps({"error": {"message": "worker died"}}), "[DONE]")),
         "worker died"),
        (httpx.Response(404, json={"error": {"message": "The model `m` does not exist", "code": 404}}),
         "HTTP 404: The model `m` does not exist"),
        (httpx.Response(503, text="upstream unavailable"), "HTTP 503: upstream unavailable"),
        (httpx.Response(200, content=_sse(_chunk("a"), _chunk("b"))), "before data: [DONE]"),
        (httpx.Response(200, content=_sse(USAGE, "[DONE]")), "no token chunk"),
        (httpx.Response(200, content=_sse("{not json", "[DONE]")), "malformed"),
    ],
)  # fmt: skip
def test_client_failures_are_records_not_exceptions(response, message):
    rec = _send_mock(lambda request: response)
    assert not rec.success and message in rec.error


def test_client_transport_error_is_a_failed_record():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    rec = _send_mock(handler)
    assert not rec.success and "ConnectError" in rec.error


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class SlowSSEServer:
    """A real HTTP/1.1 server on a socket: each POST answers three chunks after the given sleeps, then usage and
    [DONE]. Tracks requests in flight."""

    def __init__(self, sleeps=(0.15, 0.05, 0.1)):
        self.sleeps = sleeps
        self.in_flight = self.max_in_flight = self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))  # fmt: skip
                await reader.readexactly(length)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                for i, pause in enumerate(self.sleeps):
                    await asyncio.sleep(pause)
                    self._chunk(writer, _sse(_chunk(str(i))))
                    await writer.drain()
                self._chunk(writer, _sse(USAGE, "[DONE]"))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                self.in_flight -= 1
                self.served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @staticmethod
    def _chunk(writer, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def _with_server(server: SlowSSEServer, body):
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    try:
        return await body(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    finally:
        srv.close()


def test_client_timing_over_a_real_socket():
    async def body(url):
        async with httpx.AsyncClient() as http:
            return await send(http, url, "m", "completions", BenchRequest("p", 1, 3), None, time.perf_counter())

    rec = asyncio.run(_with_server(SlowSSEServer(), body))
    assert rec.success and rec.output_tokens == 3
    # Lower bounds are the server's sleeps (a gap can look a little shorter when the previous chunk was read late);
    # upper bounds leave room for a loaded machine.
    assert 0.15 <= rec.ttft_s < 0.35
    assert len(rec.itl_s) == 2 and 0.04 <= rec.itl_s[0] < 0.15 and 0.09 <= rec.itl_s[1] < 0.2
    assert rec.latency_s == pytest.approx(rec.ttft_s + sum(rec.itl_s), abs=0.05)
    assert rec.tpot_s == pytest.approx((rec.latency_s - rec.ttft_s) / 2)


@pytest.mark.parametrize(("cap", "expected_max"), [(1, 1), (None, 4)])
def test_runner_caps_concurrency_keeps_fixed_times_and_skips_warmups(cap, expected_max):
    server = SlowSSEServer(sleeps=(0.1, 0.02, 0.02))
    reqs = [BenchRequest("p", 1, 3, kind="k") for _ in range(4)]
    config = BenchConfig(base_url="http://x", model="m", max_concurrency=cap, num_warmups=2, progress=False,
                         goodput_slos={"ttft": 10_000})  # fmt: skip

    async def body(url):
        from services.bench.runner import run_benchmark

        return await run_benchmark(dataclasses.replace(config, base_url=url), reqs)

    result = asyncio.run(_with_server(server, body))
    assert server.served == 6 and len(result.records) == 4  # warm-ups sent, not recorded
    assert server.max_in_flight == expected_max
    s = result.summary
    assert s["completed"] == 4 and s["request_goodput"] > 0 and s["max_concurrency"] == cap
    if cap == 1:  # serialized: each send waits for the previous request to finish
        starts = sorted(r.start_s for r in result.records)
        assert all(b - a >= 0.13 for a, b in zip(starts, starts[1:], strict=False))
    detailed = result.to_json(detailed=True)
    assert len(detailed["itls"]) == 4 and detailed["kinds"] == ["k"] * 4 and json.dumps(detailed)


def test_runner_sends_fixed_times_on_time():
    server = SlowSSEServer(sleeps=(0.01,))
    reqs = [BenchRequest("p", 1, 1, at_s=0.0), BenchRequest("p", 1, 1, at_s=0.3)]

    async def body(url):
        from services.bench.runner import run_benchmark

        return await run_benchmark(BenchConfig(base_url=url, model="m", progress=False), reqs)

    result = asyncio.run(_with_server(server, body))
    starts = [r.start_s for r in result.records]
    assert 0 <= starts[0] < 0.1 and 0.29 <= starts[1] < 0.4
    assert result.duration_s >= 0.3


@pytest.mark.parametrize(
    "kwargs",
    [{"endpoint": "embeddings"}, {"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0},
     {"goodput_slos": {"ttft": -1}}, {"percentiles": (101,)}, {"base_url": "127.0.0.1:8000"}, {"num_warmups": -1}],
)  # fmt: skip
def test_bench_config_validates(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**({"base_url": "http://h", "model": "m"} | kwargs))


def test_cli_bad_arguments_exit_2(capsys, model_dir):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(model_dir), "--disable-tqdm"]
    assert bench_main([*argv, "--goodput", "ttfb:5"]) == 2
    assert "pdserve: error:" in capsys.readouterr().err
    assert bench_main([*argv, "--dataset-name", "interference"]) == 2  # needs a finite rate
    assert bench_main([*argv, "--dataset-name", "sharegpt"]) == 2  # needs a file
    assert bench_main(["--model", "m"]) == 2  # no tokenizer


def test_cli_all_failed_exits_1(capsys, model_dir):
    """Nothing listens on the port: every request fails, and the first errors are shown."""
    code = bench_main(["--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--tokenizer",
                       str(model_dir), "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                       "--disable-tqdm", "--timeout", "5"])  # fmt: skip
    assert code == 1
    assert "2 of 2 requests failed" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- real stack


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_bench_cli_against_a_real_stack(model_dir, tmp_path, capsys):
    stack = Stack(StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, prefill=1, decode=1))
    try:
        stack.start(ready_timeout_s=180)
        out = tmp_path / "result.json"
        code = bench_main(["--base-url", stack.url, "--model", str(model_dir), "--dataset-name", "random",
                           "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8",
                           "--request-rate", "20", "--goodput", "ttft:5000", "tpot:1000", "--result-file", str(out),
                           "--disable-tqdm", "--kv-metrics-url", *stack.metrics_urls()])  # fmt: skip
    except Exception:
        print(stack.logs())
        raise
    finally:
        stack.stop()
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s):" in printed
    result = json.loads(out.read_text())
    assert all(k in result for k in VLLM_KEYS + RESULT_KEYS)
    assert result["model_id"] == "m"  # --model was the directory: the name came from GET /v1/models
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 64)
    assert result["total_input_tokens"] == 8 * 32
    assert result["mean_ttft_ms"] > 0 and result["p99_ttft_ms"] >= result["median_ttft_ms"]
    assert result["p99_tpot_ms"] >= result["median_tpot_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"]
    assert result["request_goodput"] > 0 and result["duration"] > 0 and result["request_rate"] == 20
    assert result["dataset_name"] == "random" and result["workload"]["random_input_len"] == 32
    # Every request went on to decode: one pull each (the prefill worker's /metrics, also given, counts none).
    assert result["kv_pulls"] == 8 and result["mean_kv_pull_ms"] > 0, result
    assert result["kv_pull_share_of_ttft"] == pytest.approx(result["mean_kv_pull_ms"] / result["mean_ttft_ms"])
    assert 0 < result["kv_pull_share_of_e2el"] < 1 and "KV pulls:" in printed
