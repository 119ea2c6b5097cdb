"""Overload and shutdown: admission arithmetic (queue depth, KV capacity, Retry-After), the 429 and draining
answers over HTTP, and with real processes a flood (some 429s, every admitted request complete) and a gateway
SIGTERM'd while streams are open (each stream completes, the gateway exits 0). Plus the soak, briefly."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient
from prometheus_client import REGISTRY

from services.gateway import create_app
from services.gateway.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S, Admission, Load
from services.gateway.backend import GenerationJob, Overloaded
from services.gateway.draining import Drain
from services.gateway.liveness import WorkerTable
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.messages import Heartbeat, Sampling
from shared.settings import GatewaySettings
from tests.e2e_support import kv_keys, start_stack

REPO = Path(__file__).resolve().parents[2]

# ---- admission arithmetic ---------------------------------------------------------------------------


@dataclass
class Req:
    prompt_tokens: int
    delivered: int = 0
    first_token_seen: bool = False


def running(prompt: int, delivered: int) -> Req:
    return Req(prompt, delivered, first_token_seen=True)


def test_load_counts_pending_and_kv():
    load = Load.of([Req(10), running(20, 5), running(7, 0)])
    assert (load.requests, load.pending, load.kv_tokens) == (3, 1, 10 + 25 + 7)


def test_queue_bound():
    adm = Admission(max_pending_requests=2, kv_overcommit=1.0)
    adm.check("new", 5, {"a": Req(5), "b": running(5, 3), "c": running(5, 9)}, None, now=0.0)  # 1 pending: in
    with pytest.raises(Overloaded) as exc:
        adm.check("new2", 5, {"a": Req(5), "b": Req(5), "c": running(5, 3)}, None, now=0.0)
    assert exc.value.reason == "queue" and "2 requests are waiting for their first token (limit 2)" in str(exc.value)
    assert exc.value.retry_after_s == RETRY_AFTER_UNKNOWN_S  # nothing has left yet: no rate to go by


def test_kv_bound_with_overcommit():
    in_flight = {"a": running(40, 30)}  # holds 70 tokens
    Admission(100, kv_overcommit=1.0).check("b", 30, in_flight, kv_capacity=100, now=0.0)  # 100: exactly full
    with pytest.raises(Overloaded) as exc:
        Admission(100, kv_overcommit=1.0).check("b", 31, in_flight, kv_capacity=100, now=0.0)
    assert exc.value.reason == "kv" and "over the limit of 100" in exc.value.message
    Admission(100, kv_overcommit=1.5).check("b", 80, in_flight, kv_capacity=100, now=0.0)  # 150 allowed
    with pytest.raises(Overloaded):
        Admission(100, kv_overcommit=0.5).check("b", 1, in_flight, kv_capacity=100, now=0.0)


def test_kv_bound_skipped_when_unknown_or_alone():
    adm = Admission(100, kv_overcommit=1.0)
    adm.check("a", 10_000, {}, kv_capacity=100, now=0.0)  # alone: waiting would not make room for it
    adm.check("b", 10_000, {"x": running(5_000, 0)}, kv_capacity=None, now=0.0)  # no worker reports capacity


def test_retry_after_follows_the_departure_rate():
    adm = Admission(max_pending_requests=1, kv_overcommit=1.0, window_s=30.0)
    for i in range(10):  # admitted at t=0, one after the other (each sees the earlier ones in flight)
        adm.check(f"r{i}", 1, {f"r{j}": running(1, 1) for j in range(i)}, None, now=0.0)
    # at t=10 five of them have left: 0.5 requests/s; 3 must leave (3 pending, limit 1) → 6 s
    pending = {f"r{i}": Req(1) for i in range(5, 8)} | {"r8": running(1, 1), "r9": running(1, 1)}
    with pytest.raises(Overloaded) as exc:
        adm.check("late", 1, pending, None, now=10.0)
    assert exc.value.retry_after_s == 6
    assert adm.retry_after_s(1, now=10.0) == 2 and adm.retry_after_s(1000, now=10.0) == RETRY_AFTER_MAX_S
    assert adm.retry_after_s(1, now=45.0) == RETRY_AFTER_UNKNOWN_S  # those departures fell out of the window


def test_kv_retry_after_counts_the_requests_that_must_leave():
    adm = Admission(max_pending_requests=10, kv_overcommit=1.0, window_s=30.0)
    adm.check("a", 1, {}, None, now=0.0)
    adm.check("b", 1, {"a": running(1, 0)}, None, now=0.0)
    adm._note_departures([], now=2.0)  # both left within 2 s: 1 request/s
    in_flight = {f"r{i}": running(10, 0) for i in range(4)}  # 40 tokens, 10 per request
    with pytest.raises(Overloaded) as exc:
        adm.check("big", 25, in_flight, kv_capacity=40, now=2.0)  # 25 over: 3 requests of 10 must leave
    assert exc.value.retry_after_s == 3


def test_admission_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        Admission(0, 1.0)
    with pytest.raises(ValueError):
        Admission(1, 0.0)


# ---- live capacity ----------------------------------------------------------------------------------


def beat(worker: str, role: str, blocks: int = 0, block_size: int = 16, draining: bool = False) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        role=role,
        model="demo",
        rpc_address=None,
        total_blocks=blocks,
        free_blocks=blocks,
        block_size=block_size,
        draining=draining,
    )


def test_kv_capacity_is_decode_kv_of_live_workers_not_draining():
    table = WorkerTable(ttl_s=5.0)
    table.record(beat("p", "prefill", blocks=1000), now=0.0)  # prefill KV is short-lived: not counted
    table.record(beat("d1", "decode", blocks=10), now=0.0)
    table.record(beat("d2", "decode", blocks=5, block_size=32), now=0.0)
    table.record(beat("m", "mixed", blocks=2), now=0.0)
    table.record(beat("d3", "decode", blocks=100, draining=True), now=0.0)
    assert table.kv_capacity("demo", 1.0) == 10 * 16 + 5 * 32 + 2 * 16
    assert table.kv_capacity("other", 1.0) is None
    table.record(beat("d1", "decode", blocks=10), now=4.0)
    assert table.kv_capacity("demo", 6.0) == 160  # the others went quiet
    old = WorkerTable()
    old.record(beat("d", "decode", blocks=10, block_size=0), now=0.0)  # a worker that does not report it
    assert old.kv_capacity("demo", 0.0) is None


def test_draining_workers_do_not_serve():
    table = WorkerTable()
    table.record(beat("p", "prefill"), now=0.0)
    table.record(beat("d", "decode", draining=True), now=0.0)
    ok, reason = table.can_serve("demo", 0.0)
    assert not ok and "no live decode worker" in reason
    table.record(beat("p", "prefill", draining=True), now=0.0)
    assert table.can_serve("demo", 0.0) == (False, "every live worker for model 'demo' is draining (2 shutting down)")
    table.record(beat("d2", "decode"), now=0.0)
    table.record(beat("p2", "prefill"), now=0.0)
    assert table.can_serve("demo", 0.0) == (True, "live workers for demo: 1 prefill, 1 decode")


def _rejected(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "pdserve:requests_rejected_total", {"model_name": "demo", "role": "gateway", "reason": reason}
    )
    return value or 0.0


def test_admit_hook_counts_rejections():
    control = Admission(max_pending_requests=1, kv_overcommit=1.0)
    table = WorkerTable()
    table.record(beat("m", "mixed", blocks=4), now=time.monotonic())  # 64 tokens
    job = GenerationJob("r1", "demo", [1] * 10, Sampling(max_tokens=5))
    control.admit(table, {}, job)
    before = _rejected("queue"), _rejected("kv")
    with pytest.raises(Overloaded):
        control.admit(table, {"r1": Req(10)}, GenerationJob("r2", "demo", [1], Sampling(max_tokens=5)))
    with pytest.raises(Overloaded):
        control.admit(table, {"r1": running(50, 10)}, GenerationJob("r3", "demo", [1] * 5, Sampling(max_tokens=5)))
    assert (_rejected("queue"), _rejected("kv")) == (before[0] + 1, before[1] + 1)


# ---- the HTTP answers (in-process app, fake backends) -------------------------------------------------


class OverloadedBackend:
    def __init__(self) -> None:
        self.ready = (True, "fine")

    async def open(self, job: GenerationJob):
        raise Overloaded("the server is at capacity: try later", 7, reason="queue")

    async def cancel(self, request_id: str) -> None:
        pass

    async def readiness(self) -> tuple[bool, str]:
        return self.ready

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_429_with_retry_after(model_dir, stream):
    app = create_app(GatewaySettings(model=str(model_dir), model_name="demo"), OverloadedBackend())
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "error": {
            "message": "the server is at capacity: try later",
            "type": "rate_limit_error",
            "param": None,
            "code": 429,
        }
    }


def test_draining_gateway_refuses_new_work_and_is_not_ready(model_dir):
    drain = Drain(timeout_s=30)
    app = create_app(GatewaySettings(model=str(model_dir), model_name="demo"), OverloadedBackend(), drain=drain)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        drain.begin(time.monotonic())
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("draining")
        before = _rejected("draining")
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert _rejected("draining") == before + 1
        assert client.get("/health").status_code == 200


def test_drain_timeline():
    drain = Drain(timeout_s=20)
    assert not drain.draining and drain.left_s(100.0) == 20
    assert drain.begin(100.0) and not drain.begin(101.0)  # a second signal does not restart the clock
    assert drain.reserve_s == 5.0
    assert not drain.expired(114.9) and drain.expired(115.0)
    assert drain.left_s(112.0) == 8.0 and drain.left_s(130.0) == 0.0
    with pytest.raises(ValueError):
        Drain(0)


# ---- real processes ---------------------------------------------------------------------------------


@pytest.mark.slow  # a stack under 15 s of load, then 20 s of settling: most of a minute (make test-slow)
def test_soak_briefly(model_dir, tmp_path):
    """benchmarks/soak.py for 15 s: its report's shape, and nothing lost or left behind. Memory is not judged:
    15 s are all warm-up for it (the prefill worker's oneDNN and allocator caches fill over ~30 s)."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "benchmarks/soak.py", "--duration", "15", "--clients", "6", "--model", str(model_dir),
           "--max-growth-mib", "100000", "--settle-s", "20", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    r = result["requests"]
    assert r["lost"] == 0 and r["stop_mismatch"] == 0, r["examples"]
    assert r["sent"] == r["completed"] + r["failed_cleanly"] + r["disconnected"] > 0
    assert r["completed"] and r["disconnected"] and r["by_kind"]["stop"]["completed"]
    assert r["rejected_429"] == r["failed_by_status"].get("429", 0)
    assert set(result["rss"]) == {"gateway", "prefill-0", "decode-1", "nats", "redis"}
    for m in result["rss"].values():
        assert m["start_mib"] > 0 and m["end_mib"] > 0 and isinstance(m["slope_mib_per_min"], float)
    assert result["leftover_keys"] == [] and result["ok"] and result["problems"] == []
    assert [w["role"] for w in result["workers"].values()] == ["decode", "prefill"]
    assert all(
        w["integrity_error"] is None and w["free_blocks"] == w["total_blocks"] for w in result["workers"].values()
    )


MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(model_dir):
    """1 prefill + 1 decode; each test below starts the gateway it needs (`gateway`)."""
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1)
    stack = start_stack(spec)
    yield stack
    stack.stop()


def gateway(stack: Stack, *args: str) -> subprocess.Popen:
    """Replace the stack's gateway with one started with these extra flags; ready when it returns."""
    old = stack.procs.get("gateway")
    if old is not None and old.poll() is None:
        old.terminate()
        old.wait(timeout=30)
    flags = ["--model", stack.spec.model]  # NATS and Redis URLs and credentials come with spawn()'s environment
    proc = stack.spawn("gateway", ["gateway", "--port", str(stack.spec.port), "--host", stack.spec.host, *flags, *args])
    stack.wait_ready(60)
    return proc


def body(i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    prompt = f"request {i}: " + "tell me about disaggregated serving " * (3 + i % 5)
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    done: bool = False  # streams: ended with [DONE]


def read_answer(resp: httpx.Response, stream: bool) -> Answer:
    if resp.status_code != 200:
        return Answer(resp.status_code, dict(resp.headers), resp.read().decode())
    if stream:
        return parse_sse(resp.iter_lines())
    whole = json.loads(resp.read())
    choice, usage = whole["choices"][0], whole["usage"]
    return Answer(200, dict(resp.headers), choice["text"], choice["finish_reason"], usage["completion_tokens"], True)


def parse_sse(lines: Iterable[str]) -> Answer:
    """A 200 stream's events: text, the finish reason of its last chunk, one chunk per token, [DONE] last."""
    answer = Answer(200, {})
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: ") and not answer.done, line
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            answer.done = True
            continue
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        answer.completion_tokens += 1
        answer.text += chunk["choices"][0]["text"]
        answer.finish_reason = chunk["choices"][0]["finish_reason"] or answer.finish_reason
    return answer


def post(url: str, i: int, stream: bool, start: threading.Barrier | None = None) -> Answer:
    with httpx.Client(timeout=60) as client:
        if start is not None:
            start.wait()
        with client.stream("POST", f"{url}/v1/completions", json=body(i, stream)) as resp:
            return read_answer(resp, stream)


def assert_complete(answer: Answer) -> None:
    assert answer.status == 200 and answer.done, answer
    assert answer.finish_reason == "length" and answer.completion_tokens == MAX_TOKENS, answer


def wait_no_keys(redis_url: str, timeout_s: float = 15.0) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while (keys := kv_keys(redis_url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return keys


def rejected_at(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith("pdserve:requests_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize(
    "reason, flags",
    [("queue", ("--max-pending-requests", "2")), ("kv", ("--kv-overcommit", "0.000001"))],
    ids=["queue-depth", "kv-capacity"],
)
def test_flood_gets_429s_and_every_admitted_request_completes(stack, reason, flags):
    """24 requests at once against a small bound (kv: a limit of ~0 tokens, so a request is admitted only
    alone; that needs the decode worker's heartbeat to report its capacity)."""
    gateway(stack, *flags)
    n = 24
    start = threading.Barrier(n)
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: post(stack.url, i, i % 2 == 0, start), range(n)))
    refused = [a for a in answers if a.status == 429]
    admitted = [a for a in answers if a.status == 200]
    assert len(refused) + len(admitted) == n, [a for a in answers if a.status not in (200, 429)]
    assert refused and admitted
    for answer in admitted:
        assert_complete(answer)
    for answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        error = json.loads(answer.text)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == 429 and "retry in" in error["message"]
    assert rejected_at(stack.url, reason) == len(refused)
    assert_complete(post(stack.url, 99, stream=True))  # the flood is over: served again
    assert wait_no_keys(stack.redis_url) == []


def test_sigterm_drains_open_streams_then_exits_0(stack):
    gw = gateway(stack, "--drain-timeout-s", "30")
    n = 4
    first_chunk = [threading.Event() for _ in range(n)]

    def stream(i: int) -> Answer:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body(i, True)) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                head = next(line for line in lines if line)  # the first token's chunk
                first_chunk[i].set()
                return parse_sse(itertools.chain([head], lines))

    decode = stack.procs["decode-1"]
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, i) for i in range(n)]
        assert all(e.wait(30) for e in first_chunk)
        decode.send_signal(signal.SIGSTOP)  # the streams cannot end while the gateway is checked below
        try:
            gw.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while (ready := httpx.get(f"{stack.url}/ready")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ready.status_code == 503 and ready.json()["error"]["message"].startswith("draining")
            late = httpx.post(f"{stack.url}/v1/completions", json=body(9, False))
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
            assert gw.poll() is None  # still serving its streams
        finally:
            decode.send_signal(signal.SIGCONT)
        answers = [f.result() for f in futures]
    for answer in answers:
        assert_complete(answer)
    assert gw.wait(timeout=30) == 0
    assert wait_no_keys(stack.redis_url) == []


def test_drain_timeout_ends_stragglers_with_an_error_and_exits_0(stack):
    drain_s = 4.0
    gw = gateway(stack, "--drain-timeout-s", str(drain_s))
    n = 2
    first_chunk = [threading.Event() for _ in range(n)]

    def stream(i: int) -> list[str]:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body(i, True)) as resp:
                events = []
                for line in resp.iter_lines():
                    if line:
                        events.append(line[len("data: ") :])
                        first_chunk[i].set()
                return events

    decode = stack.procs["decode-1"]
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, i) for i in range(n)]
        assert all(e.wait(30) for e in first_chunk)
        decode.send_signal(signal.SIGSTOP)  # the streams outlast the drain timeout
        try:
            gw.send_signal(signal.SIGTERM)
            code = gw.wait(timeout=drain_s + 10)
            ended = [f.result(timeout=10) for f in futures]
        finally:
            decode.send_signal(signal.SIGCONT)
    assert code == 0
    for events in ended:
        *chunks, error, done = events
        assert chunks and all("choices" in json.loads(c) for c in chunks)
        assert json.loads(error)["error"]["message"] == "the gateway is shutting down" and done == "[DONE]"
