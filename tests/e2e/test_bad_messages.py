"""Malformed messages sent straight onto the subjects the services read, bypassing the gateway: the job queues
(pd.jobs.prefill / pd.jobs.decode), pd.cancel.*, pd.hb.*, pd.resend.* and a gateway's token subjects.

Against a real stack (1 prefill + 1 decode worker on the tiny demo model, workers at a shorter context than
the gateway's). After each batch: every process is alive, a normal request is answered as before, each
dropped job has a worker log line naming why, a job with a valid reply subject got an error event back,
JetStream holds no job (terminated, not redelivered), and the workers' heartbeats report sound block
accounting. Below them, the pure checks of shared/job_checks.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import msgspec
import nats
import pytest

from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.job_checks import job_problem, job_refusal, reply_subject_problem, sampling_problem
from shared.kv.tickets import Tickets
from shared.kv.transfer.server import SERVICE
from shared.messages import (
    JOBS_STREAM,
    Cancel,
    DecodeJob,
    FailedEvent,
    FinishedEvent,
    Heartbeat,
    PrefillJob,
    ResendItem,
    ResendRequest,
    Sampling,
    TokenEvent,
    TokensEvent,
    decode,
    decode_event,
    decode_event_or_drop,
    decode_or_drop,
    decode_subject,
    encode,
    prefill_subject,
    resend_subject,
)
from shared.model.tokenizer import Tokenizer
from shared.rpc import kv_transfer_pb2 as pb
from tests.e2e_support import heartbeats, scraped_total, start_stack

MODEL = "demo"
WORKER_CONTEXT = 256  # the workers' max_model_len; the gateway allows the checkpoint's 2048
VOCAB = 259  # the tiny demo checkpoint's
PROMPT = "The quick brown fox"
REPLY = "pd.tokens.fuzz"  # the reply subjects of the jobs sent here: REPLY.<request id>
GREEDY = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)


# ---- the pure checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "sampling", "outputs", "fragment"),
    [
        ([], GREEDY, (), "the prompt is empty"),
        ([1, -1], GREEDY, (), "prompt_token_ids[1] = -1 is outside the vocabulary [0, 259)"),
        ([1, VOCAB], GREEDY, (), "prompt_token_ids[1] = 259"),
        ([1], GREEDY, (5, 10**20), "output_token_ids[1] = 100000000000000000000"),
        ([1] * 200, GREEDY, [1] * 56, "the prompt has 256 tokens; max_model_len is 256"),
        ([1], Sampling(max_tokens=0), (2,), "max_tokens must be at least 1 for a job that carries output tokens"),
        ([1], Sampling(max_tokens=-3), (), "max_tokens must be at least 0"),
        ([1], Sampling(max_tokens=4, temperature=-0.5), (), "temperature must be in [0, 100]"),
        ([1], Sampling(max_tokens=4, temperature=float("inf")), (), "temperature must be in [0, 100]"),
        ([1], Sampling(max_tokens=4, temperature=float("nan")), (), "temperature must be in [0, 100]"),
        ([1], Sampling(max_tokens=4, top_p=0.0), (), "top_p must be in (0, 1]"),
        ([1], Sampling(max_tokens=4, top_p=1.5), (), "top_p must be in (0, 1]"),
        ([1], Sampling(max_tokens=4, top_k=0), (), "top_k must be at least 1"),
        ([1], Sampling(max_tokens=4, stop_token_ids=[3, 999]), (), "stop_token_ids[1] = 999"),
    ],
)
def test_job_problem_names_what_is_wrong(prompt, sampling, outputs, fragment):
    problem = job_problem(prompt, sampling, VOCAB, WORKER_CONTEXT, outputs)
    assert problem is not None and fragment in problem


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        Sampling(max_tokens=10**30),  # runs until the context is full: not a problem
        Sampling(max_tokens=1, temperature=1e-300, top_p=1e-9, top_k=10**12, seed=-(10**40)),
        Sampling(max_tokens=1, temperature=100.0, stop_token_ids=[0, VOCAB - 1]),
    ],
)
def test_runnable_jobs_pass(sampling):
    assert job_problem([0, VOCAB - 1], sampling, VOCAB, WORKER_CONTEXT, (5,)) is None
    assert job_problem([1] * 254, sampling, VOCAB, WORKER_CONTEXT, (1,)) is None  # 255 < 256: one more fits


def test_tiny_temperatures_sample_greedily():
    """0 < temperature < GREEDY_BELOW is greedy (as in vLLM): dividing the logits by it would overflow and the
    sampler would fail on the engine thread, where a failure stops every request."""
    import torch

    from shared.engine.sampling import GREEDY_BELOW, Sampler, SamplingParams

    logits = torch.randn(2, VOCAB) * 10
    greedy = logits.argmax(dim=-1).tolist()
    tiny, zero = SamplingParams(temperature=1e-300), SamplingParams(temperature=0.0)
    assert Sampler(0).sample(logits, [tiny, zero], [0, 0]) == greedy
    assert Sampler(0).sample(logits[:1], [SamplingParams(temperature=GREEDY_BELOW)], [0])  # samples at the bound
    assert sampling_problem(Sampling(max_tokens=1, temperature=1e-300), VOCAB) is None


@pytest.mark.parametrize(
    ("subject", "valid"),
    [
        ("pd.tokens.gw-1.cmpl-abc_1", True),
        ("pd.tokens.>", False),
        ("pd.tokens.*.x", False),
        ("pd.tokens.gw.x.y", False),
        ("pd.tokens.gw.", False),
        ("", False),
        ("pd.jobs.prefill.demo", False),  # would feed token events into a job queue
        ("pd.cancel.x", False),
        ("pd.tokens.gw.a b", False),
    ],
)
def test_reply_subjects(subject, valid):
    assert (reply_subject_problem(subject) is None) == valid


def test_refusal_says_whether_an_error_event_can_go_back():
    ok = PrefillJob("r", MODEL, [1, 2], GREEDY, f"{REPLY}.r")
    assert job_refusal(ok, VOCAB, WORKER_CONTEXT) is None
    bad_tokens = msgspec.structs.replace(ok, prompt_token_ids=[VOCAB])
    assert job_refusal(bad_tokens, VOCAB, WORKER_CONTEXT).reply
    for bad_address in (
        msgspec.structs.replace(bad_tokens, reply_subject="pd.tokens.>"),
        msgspec.structs.replace(ok, request_id=""),
        msgspec.structs.replace(ok, request_id="x" * 1000),
    ):
        refusal = job_refusal(bad_address, VOCAB, WORKER_CONTEXT)
        assert refusal is not None and not refusal.reply
    decode_job = DecodeJob("d", MODEL, [1], [VOCAB + 5], GREEDY, f"{REPLY}.d")
    assert "output_token_ids[0]" in job_refusal(decode_job, VOCAB, WORKER_CONTEXT).reason


def test_deeply_nested_json_is_malformed_not_fatal():
    """msgspec raises RecursionError past its nesting limit; it stopped a worker's job loop (which drops
    DecodeError / ValidationError only)."""
    deep = b'{"request_id": "x", "y": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        decode(deep, PrefillJob)
    assert decode_or_drop(deep, Cancel, "pd.cancel.x") is None


@pytest.mark.parametrize(
    "event",
    [
        {"seq": -1, "token_ids": [5]},
        {"seq": 0, "token_ids": [-1]},
        {"seq": 0, "token_ids": [2**64]},
        {"seq": 0, "token_ids": [5], "attempt": -2},
    ],
)
def test_token_events_with_impossible_values_are_malformed(event):
    """A negative position or token id on a live request's subject broke its stream mid-body (the
    detokenizer cannot decode a negative id): the gateway now drops such an event as malformed."""
    payload = json.dumps({"request_id": "r", "attempt": 0} | event).encode()
    assert decode_event_or_drop(payload, "pd.tokens.gw.r") is None


# ---- a real stack -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    spec = StackSpec(
        model=str(model_dir),
        port=free_port(),
        prefill=1,
        decode=1,
        threads_per_worker=1,
        worker_args=("--max-model-len", str(WORKER_CONTEXT)),
    )
    stack = start_stack(spec, log_dir=str(tmp_path_factory.mktemp("logs")))
    yield stack
    stack.stop()


def _complete(url: str, prompt: str | list[int] = PROMPT, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | extra
    with httpx.Client(timeout=60) as client:
        return client.post(f"{url}/v1/completions", json=body)


@pytest.fixture(scope="module")
def baseline(stack) -> str:
    resp = _complete(stack.url)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    return Tokenizer(model_dir).encode(PROMPT)


def _worker_log(stack: Stack, role: str) -> str:
    (path,) = stack.log_dir.glob(f"{role}-*.log")  # one worker of each role
    return path.read_text(errors="replace")


def _gateway_log(stack: Stack) -> str:
    return (stack.log_dir / "gateway.log").read_text(errors="replace")


def _wait_for(what, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(0.1)
    return what()


class Bus:
    """A NATS client on the stack's server, sending raw bytes and collecting the token events of REPLY.>."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: dict[str, list[TokenEvent]] = {}

    async def __aenter__(self) -> Bus:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await self.nc.subscribe(f"{REPLY}.>", cb=self._on_event)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.drain()

    async def _on_event(self, msg) -> None:
        event = decode_event(msg.data)
        self.events.setdefault(event.request_id, []).append(event)

    async def job(self, subject: str, payload: bytes | msgspec.Struct) -> None:
        await self.js.publish(subject, payload if isinstance(payload, bytes) else encode(payload))

    async def core(self, subject: str, payload: bytes | msgspec.Struct) -> None:
        await self.nc.publish(subject, payload if isinstance(payload, bytes) else encode(payload))
        await self.nc.flush()

    async def final(self, request_id: str, timeout_s: float = 20.0) -> FinishedEvent | FailedEvent:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [e for e in self.events.get(request_id, []) if isinstance(e, FinishedEvent | FailedEvent)]
            if done:
                return done[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no final event for {request_id}: {self.events.get(request_id)}")

    async def failure(self, request_id: str) -> FailedEvent:
        event = await self.final(request_id)
        assert isinstance(event, FailedEvent), event
        return event

    def tokens(self, request_id: str) -> list[int]:
        """The request's tokens in output order (each position once; a decode job's start after its first)."""
        outputs = [e for e in self.events.get(request_id, []) if isinstance(e, TokensEvent | FinishedEvent)]
        by_seq = {e.seq + i: t for e in outputs for i, t in enumerate(e.token_ids)}
        return [by_seq[i] for i in sorted(by_seq)]

    async def jetstream_is_empty(self, timeout_s: float = 10.0) -> str | None:
        """None once every job has left the stream and no consumer waits for an ack; else what is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = await self.js.stream_info(JOBS_STREAM)
            left = f"{info.state.messages} messages in {JOBS_STREAM}"
            if info.state.messages == 0:
                consumers = [await self.js.consumer_info(JOBS_STREAM, name) for name in await self._consumers()]
                pending = {c.name: (c.num_pending, c.num_ack_pending) for c in consumers}
                if all(p == (0, 0) for p in pending.values()):
                    return None
                left = f"pending / unacked per consumer: {pending}"
            if time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.1)

    async def _consumers(self) -> list[str]:
        return [c.name for c in await self.js.consumers_info(JOBS_STREAM)]


def _assert_healthy(stack: Stack, baseline: str) -> None:
    for name, proc in stack.procs.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{stack.logs()}"
    resp = _complete(stack.url)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == baseline
    beats = heartbeats(stack.nats_url, seconds=1.5)
    assert {b.role for b in beats.values()} == {"prefill", "decode"}
    assert all(b.integrity_error is None for b in beats.values()), beats


def _prefill_job(request_id: str, prompt: list[int], sampling: Sampling = GREEDY, **kw) -> PrefillJob:
    return PrefillJob(request_id, MODEL, prompt, sampling, kw.pop("reply_subject", f"{REPLY}.{request_id}"), **kw)


MALFORMED = [
    b"\x00\xff\xfe garbage",
    b"not json at all",
    b"[1, 2, 3]",
    b'{"request_id": 5}',
    b'{"request_id": "x", "model": "demo", "prompt_token_ids": "abc", "sampling": {}, "reply_subject": "s"}',
    b'{"request_id": "x", "model": "demo", "prompt_token_ids": [1.5], "sampling": {"max_tokens": 1}, '
    b'"reply_subject": "pd.tokens.fuzz.x"}',
    b'{"request_id": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than decoders recurse
    b"",
]


def test_malformed_and_bad_prefill_jobs(stack, baseline, prompt_ids):
    subject = prefill_subject(MODEL)
    # (request id, job, a fragment of the reason the worker logs and, for replyable ones, sends back)
    semantic = [
        ("empty", _prefill_job("empty", []), "the prompt is empty"),
        ("negative", _prefill_job("negative", [1, -7, 2]), "prompt_token_ids[1] = -7 is outside"),
        ("vocab", _prefill_job("vocab", [1, VOCAB]), f"prompt_token_ids[1] = {VOCAB} is outside"),
        ("too-long", _prefill_job("too-long", [1] * (WORKER_CONTEXT + 10)), "max_model_len is 256"),
        ("huge", _prefill_job("huge", [2] * 150_000), "max_model_len is 256"),  # ~450 kB of JSON
        ("negative-max", _prefill_job("negative-max", prompt_ids, Sampling(max_tokens=-1)), "max_tokens must be at"),
        ("cold", _prefill_job("cold", prompt_ids, Sampling(max_tokens=4, temperature=-1.0)), "temperature must"),
        ("top-p", _prefill_job("top-p", prompt_ids, Sampling(max_tokens=4, top_p=0.0)), "top_p must be"),
        ("stop-ids", _prefill_job("stop-ids", prompt_ids, Sampling(max_tokens=4, stop_token_ids=[-1])), "stop_tok"),
    ]
    unanswerable = [
        (_prefill_job("wild", prompt_ids, reply_subject="pd.tokens.>"), "is not a token subject"),
        (_prefill_job("star", prompt_ids, reply_subject="pd.tokens.*.star"), "is not a token subject"),
        (_prefill_job("into-queue", prompt_ids, reply_subject=subject), "is not a token subject"),
        (_prefill_job("", prompt_ids, reply_subject=f"{REPLY}.x"), "request_id must have 1 to 256 characters"),
    ]
    enormous = _prefill_job("enormous", prompt_ids, Sampling(max_tokens=10**30, temperature=0.0, ignore_eos=True))
    malformed_before = _worker_log(stack, "prefill").count("dropping malformed job")

    async def scenario():
        async with Bus(stack.nats_url) as bus:
            for payload in MALFORMED:
                await bus.job(subject, payload)
            for _, job, _ in semantic:
                await bus.job(subject, job)
            for job, _ in unanswerable:
                await bus.job(subject, job)
            await bus.job(subject, enormous)  # a job like any other: it runs until the context is full
            # a good job under trace headers that are not W3C trace context
            junk = {"traceparent": "00-zz-not-a-trace-01", "tracestate": "=" * 4000, "baggage": "\u00ff"}
            await bus.js.publish(subject, encode(_prefill_job("junk-headers", prompt_ids)), headers=junk)
            for request_id, _, reason in semantic:
                event = await bus.failure(request_id)
                assert (event.finish_reason, event.status) == ("error", 400), event
                assert reason in event.error
            assert (await bus.final("junk-headers")).finish_reason == "length"
            final = await bus.final("enormous", timeout_s=60)
            assert final.finish_reason == "length" and len(bus.tokens("enormous")) == WORKER_CONTEXT - len(prompt_ids)
            assert await bus.jetstream_is_empty() is None
            assert not set(bus.events) & {"wild", "star", "into-queue", ""}

    asyncio.run(scenario())
    log = _wait_for(lambda: _worker_log(stack, "prefill"))
    assert log.count("dropping malformed job") - malformed_before == len(MALFORMED), log[-5000:]
    for request_id, _, reason in semantic:
        assert f"refusing job {request_id!r} on {subject}: " in log and reason in log
    for job, reason in unanswerable:
        assert f"refusing job {job.request_id!r} on {subject}: " in log and reason in log
    _assert_healthy(stack, baseline)


def test_malformed_and_bad_decode_jobs(stack, baseline, prompt_ids):
    subject = decode_subject(MODEL)
    malformed_before = _worker_log(stack, "decode").count("dropping malformed job")
    refused = [
        (DecodeJob("d-vocab", MODEL, prompt_ids, [VOCAB + 3], GREEDY, f"{REPLY}.d-vocab"), "output_token_ids[0]"),
        (DecodeJob("d-neg", MODEL, [-1], [1], GREEDY, f"{REPLY}.d-neg"), "prompt_token_ids[0] = -1"),
        (DecodeJob("d-empty", MODEL, [], [1], GREEDY, f"{REPLY}.d-empty"), "the prompt is empty"),
        (DecodeJob("d-long", MODEL, [1] * 200, [1] * 60, GREEDY, f"{REPLY}.d-long"), "max_model_len is 256"),
        (
            DecodeJob("d-zero", MODEL, prompt_ids, [1], Sampling(max_tokens=0), f"{REPLY}.d-zero"),
            "max_tokens must be at least 1",
        ),
    ]
    wild = DecodeJob("d-wild", MODEL, prompt_ids, [1], GREEDY, "pd.tokens.*.d-wild")

    async def scenario():
        async with Bus(stack.nats_url) as bus:
            # the reference: a well-formed prefill job sent the same way runs prefill, hand-off and decode
            await bus.job(prefill_subject(MODEL), _prefill_job("ref", prompt_ids))
            assert (await bus.final("ref")).finish_reason == "length"
            reference = bus.tokens("ref")
            assert len(reference) == GREEDY.max_tokens
            for payload in MALFORMED:
                await bus.job(subject, payload)
            for job, _ in refused:
                await bus.job(subject, job)
            await bus.job(subject, wild)
            # the prefill worker it names does not exist and no KV location is recorded: recomputed
            ghost = DecodeJob(
                "ghost", MODEL, prompt_ids, reference[:1], GREEDY, f"{REPLY}.ghost", prefill_worker="gone"
            )
            await bus.job(subject, ghost)
            for job, reason in refused:
                event = await bus.failure(job.request_id)
                assert (event.finish_reason, event.status) == ("error", 400) and reason in event.error, event
            assert (await bus.final("ghost")).finish_reason == "length"
            assert bus.tokens("ghost") == reference[1:]
            assert await bus.jetstream_is_empty() is None
            assert "d-wild" not in bus.events

    asyncio.run(scenario())
    log = _worker_log(stack, "decode")
    assert log.count("dropping malformed job") - malformed_before == len(MALFORMED), log[-5000:]
    for job, reason in [*refused, (wild, "is not a token subject")]:
        assert f"refusing job {job.request_id!r} on {subject}: " in log and reason in log
    assert "no KV location for ghost" in log
    _assert_healthy(stack, baseline)


def _malformed(payloads: list[bytes], kind: type[msgspec.Struct]) -> int:
    """How many of `payloads` a reader of `kind` drops (some of MALFORMED are, say, valid Cancels)."""
    return sum(decode_or_drop(p, kind, "test") is None for p in payloads)


def _resent(stack: Stack) -> float:
    """Token events the workers have sent again so far."""
    return sum(scraped_total(url, "pdserve:token_events_resent_total") for url in stack.metrics_urls())


def _stream_text(url: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            raw = resp.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", raw[-1000:]
    return "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])


def test_bad_cancels_heartbeats_and_token_events(stack, baseline):
    long_run = 240  # tokens (of the workers' 256): the request still streams while the bad events arrive
    expected = _complete(stack.url, max_tokens=long_run).json()["choices"][0]["text"]
    drops_before = {role: _worker_log(stack, role).count("dropping malformed Cancel") for role in ("prefill", "decode")}
    resend_drops_before = {r: _worker_log(stack, r).count("dropping malformed ResendRequest") for r in drops_before}
    resent_before = _resent(stack)
    absurd = Heartbeat(
        "absurd", "decode", MODEL, None, running=-1, free_blocks=-(10**9), total_blocks=-(10**9), block_size=-16
    )
    bad_events = [
        *MALFORMED,
        b'{"request_id": "x", "attempt": "one", "seq": 0, "token_ids": []}',
        b'{"request_id": "x", "attempt": 0, "seq": 0, "token_ids": [18446744073709551616]}',
    ]
    streamed: list[str] = []

    async def scenario():
        async with Bus(stack.nats_url) as bus:
            gateway_subjects: list[str] = []

            async def seen(msg) -> None:
                if not msg.subject.startswith(f"{REPLY}."):
                    gateway_subjects.append(msg.subject)

            await bus.nc.subscribe("pd.tokens.>", cb=seen)
            live = asyncio.get_running_loop().run_in_executor(
                None, lambda: streamed.append(_stream_text(stack.url, long_run))
            )
            while not gateway_subjects:
                await asyncio.sleep(0.01)
            live_subject = gateway_subjects[0]
            live_id = live_subject.rsplit(".", 1)[1]  # the request id (ids are safe subject tokens)
            # well-formed JSON, impossible values: a position before the first, token ids no vocabulary has
            for seq, ids in ((-1, [-1] * 1000), (-(10**6), [2**64] * 10), (0, [-5])):
                event = {"request_id": live_id, "attempt": 0, "seq": seq, "token_ids": ids}
                await bus.core(live_subject, json.dumps(event).encode())
            # the live request's token subject, and another request's of the same gateway
            for subject in (live_subject, live_subject.rsplit(".", 1)[0] + ".nobody"):
                for payload in bad_events:
                    await bus.core(subject, payload)
            for payload in MALFORMED:
                await bus.core("pd.cancel.x", payload)
                await bus.core("pd.hb.decode.fake", payload)
            await bus.core("pd.cancel.nobody", Cancel("nobody"))
            await bus.core("pd.cancel.long", Cancel("x" * 500_000))
            await bus.core("pd.hb.decode.absurd", absurd)
            await bus.core("pd.hb.nonsense.who", msgspec.structs.replace(absurd, worker_id="who", role="nonsense"))
            for payload in MALFORMED:
                await bus.core(resend_subject(MODEL), payload)
            # well-formed asks: everything of the live request again, mid-stream (what a gateway asks after it got
            # back to NATS), and positions of no request: each of its positions must still reach the client once
            everything = ResendItem(live_id, 0, 0)
            await bus.core(resend_subject(MODEL), ResendRequest([everything, ResendItem("nobody", 0, 10**9)]))
            await live

    asyncio.run(scenario())
    assert streamed == [expected]  # the bad events on its subject, and its events sent twice, changed nothing
    assert _resent(stack) > resent_before  # they were sent twice: the workers answered the ask
    # The workers log the cancels as they take them from NATS, which may be after the stream ended: wait for the
    # count to arrive (or the timeout), then check it is exact.
    drops = _malformed(MALFORMED, Cancel)
    for role, before in drops_before.items():

        def logged(role=role, before=before) -> str:
            log = _worker_log(stack, role)
            return log if log.count("dropping malformed Cancel") - before >= drops else ""

        log = _wait_for(logged) or _worker_log(stack, role)
        assert log.count("dropping malformed Cancel") - before == drops, log[-3000:]
        resend_drops, resend_before = _malformed(MALFORMED, ResendRequest), resend_drops_before[role]

        def resend_logged(role=role, before=resend_before, want=resend_drops) -> str:
            log = _worker_log(stack, role)
            return log if log.count("dropping malformed ResendRequest") - before >= want else ""

        log = _wait_for(resend_logged) or _worker_log(stack, role)
        assert log.count("dropping malformed ResendRequest") - resend_before == resend_drops, log[-3000:]
    heartbeats_dropped = _malformed(MALFORMED, Heartbeat)
    _wait_for(
        lambda: _gateway_log(stack).count("dropping malformed Heartbeat on pd.hb.decode.fake") >= heartbeats_dropped
    )
    gateway_log = _gateway_log(stack)
    assert gateway_log.count("dropping malformed Heartbeat on pd.hb.decode.fake") == heartbeats_dropped
    dropped = sum(decode_event_or_drop(p, "test") is None for p in bad_events)
    assert gateway_log.count("dropping malformed TokenEvent") >= 2 * dropped
    _assert_healthy(stack, baseline)


def test_bad_grpc_calls_to_the_prefill_worker(stack, baseline):
    """Garbage and unauthorised calls straight to a running prefill worker's KV transfer service: each gets an
    error status (never OK, never an internal error), the refusal is logged, and the worker serves on."""
    (address,) = {b.rpc_address for b in heartbeats(stack.nats_url, seconds=1.5).values() if b.role == "prefill"}
    ticket = Tickets(b"not the cluster secret, but long").mint("decode-x", "some-request")
    calls = [
        ("Pull", b"\x00\xff garbage that is no protobuf"),
        ("Connect", b"\xff" * 64),
        ("Pull", pb.PullRequest().SerializeToString()),  # empty: no ids, no ticket
        ("Pull", pb.PullRequest(request_id="r" * 100_000, decode_worker_id="d").SerializeToString()),
        (
            "Pull",
            pb.PullRequest(
                request_id="some-request", decode_worker_id="decode-x", ticket=ticket, pair_id="p"
            ).SerializeToString(),
        ),  # fmt: skip
        ("Connect", pb.ConnectRequest(decode_worker_id="decode-x", backend=7).SerializeToString()),
        (
            "Connect",
            pb.ConnectRequest(
                decode_worker_id="decode-x", backend=pb.BACKEND_GLOO, ticket="v1.forged.ticket"
            ).SerializeToString(),
        ),  # fmt: skip
    ]

    async def send_all() -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(address) as channel:
            for method, payload in calls:
                try:
                    await channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        return codes

    codes = asyncio.run(send_all())
    assert grpc.StatusCode.OK not in codes, codes
    assert not {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN} & set(codes), codes
    assert _wait_for(lambda: _worker_log(stack, "prefill").count("refused") >= len(calls) - 2), _worker_log(
        stack, "prefill"
    )[-3000:]
    _assert_healthy(stack, baseline)
