"""NatsBackend against a real nats-server and redis-server, started here on free ports: dispatch through
JetStream, one listener demultiplexing token events (out of order, duplicated, stale), cancels, heartbeats
behind readiness, deadlines, and the whole app with the backend its lifespan opens.

A scripted FakeWorker speaks the worker side of shared.messages. Each test serves its own model name, so
jobs a test leaves in the work queue never reach another test's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pytest
from litestar.testing import TestClient
from prometheus_client import REGISTRY

from services.gateway import create_app
from services.gateway.backend import BackendUnavailable, GenerationJob, Update
from services.gateway.nats_backend import NatsBackend
from services.gateway.path_signals import DEFAULT_PREFILL_TOKENS_PER_S
from shared import bus
from shared.messages import (
    CANCEL_WILDCARD,
    Cancel,
    FinishedEvent,
    FinishReason,
    Heartbeat,
    PrefillJob,
    Sampling,
    TokenEvent,
    TokensEvent,
    decode,
    encode,
    heartbeat_subject,
    prefill_subject,
    token_subject,
)
from shared.model.tokenizer import Tokenizer
from shared.ports import free_port
from shared.settings import GatewaySettings, PrefillPathSettings

NATS_SERVER = Path(sys.executable).parent / "nats-server"
REDIS_SERVER = shutil.which("redis-server")
Script = Callable[[PrefillJob], list[TokenEvent]]


@contextlib.contextmanager
def server(args: list[str], port: int) -> Iterator[None]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            assert proc.poll() is None and time.monotonic() < deadline, f"{args[0]} did not start"
            time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    port = free_port()
    store = tmp_path_factory.mktemp("jetstream")
    with server([str(NATS_SERVER), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)], port):
        yield f"nats://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def redis_url():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with server(args, port):
        yield f"redis://127.0.0.1:{port}/0"


def settings(checkpoint, nats_url, redis_url, model: str, **overrides) -> GatewaySettings:
    return GatewaySettings(
        model=str(checkpoint),
        model_name=model,
        nats_url=nats_url,
        redis_url=redis_url,
        gateway_id="gw-test",
        **overrides,
    )


def in_order(job: PrefillJob) -> list[TokenEvent]:
    """Echo the prompt back, one token per event, then a final event."""
    ids = job.prompt_token_ids
    events = [TokensEvent(job.request_id, 0, i, [t]) for i, t in enumerate(ids)]
    return [*events, FinishedEvent(job.request_id, 0, len(ids), [], finish_reason=FinishReason.STOP)]


class FakeWorker:
    """Heartbeats as `role` (reporting `waiting_tokens` queued), pulls prefill jobs of `model`, answers each with
    `script(job)`; records cancels."""

    def __init__(
        self, nats_url: str, model: str, role: str = "mixed", script: Script = in_order, waiting_tokens: int = 0
    ) -> None:
        self.nats_url, self.model, self.role, self.script = nats_url, model, role, script
        self.waiting_tokens = waiting_tokens
        self.jobs: list[PrefillJob] = []
        self.cancels: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> FakeWorker:
        self.nc = await nats.connect(self.nats_url)
        js = self.nc.jetstream()
        await bus.ensure_jobs_stream(js)
        self.consumer = await bus.job_consumer(js, prefill_subject(self.model))
        await self.nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel)
        await self.nc.flush()  # the server knows the subscription before anyone publishes a cancel
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._serve())]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.nc.close()

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel).request_id)

    async def _heartbeats(self) -> None:
        beat = Heartbeat(worker_id=f"{self.role}-1", role=self.role, model=self.model, rpc_address=None,
                         waiting_tokens=self.waiting_tokens)  # fmt: skip
        while True:
            await self.nc.publish(heartbeat_subject(self.role, beat.worker_id), encode(beat))
            await asyncio.sleep(0.1)

    async def _serve(self) -> None:
        while True:
            try:
                msgs = await self.consumer.fetch(batch=1, timeout=0.2)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                job = decode(msg.data, PrefillJob)
                self.jobs.append(job)
                await msg.ack()
                for event in self.script(job):
                    await self.nc.publish(job.reply_subject, encode(event))

    async def wait_heartbeat_seen(self, backend: NatsBackend) -> None:
        while not backend.workers.can_serve(self.model, time.monotonic())[0]:
            await asyncio.sleep(0.02)


async def started(s: GatewaySettings) -> NatsBackend:
    backend = NatsBackend(s)
    await backend.start()
    while (await backend.readiness())[1].startswith("not connected"):
        await asyncio.sleep(0.02)
    return backend


def run(coro, limit_s: float = 15.0) -> None:
    start = time.monotonic()
    asyncio.run(asyncio.wait_for(coro, limit_s))
    # wait_for returns quietly when the coroutine swallows its cancellation: check the clock too
    assert time.monotonic() - start < limit_s, "the scenario hung"


def job(request_id: str, model: str, prompt: list[int], max_tokens: int = 8) -> GenerationJob:
    return GenerationJob(request_id, model, prompt, Sampling(max_tokens=max_tokens, temperature=0.0))


async def drain(stream) -> list[Update]:
    return [u async for u in stream]


def test_dispatch_and_demultiplex_out_of_order_events(checkpoint, nats_url, redis_url):
    def shuffled(job: PrefillJob) -> list[TokenEvent]:
        r, (a, b, c) = job.request_id, job.prompt_token_ids
        return [
            TokensEvent(r, 0, 1, [b]),  # decode worker overtakes the prefill worker's first token
            TokensEvent(r, 0, 0, [a]),
            TokensEvent(r, 0, 0, [a, b]),  # duplicate (a re-sent batch)
            FinishedEvent(r, 1, 2, [c], finish_reason=FinishReason.STOP),  # a re-dispatch finished the request
            FinishedEvent(r, 0, 2, [99], finish_reason=FinishReason.LENGTH),  # the old attempt, too late: stale
        ]

    async def scenario() -> None:
        s = settings(checkpoint, nats_url, redis_url, "demux")
        backend = await started(s)
        async with FakeWorker(nats_url, "demux", script=shuffled) as worker:
            await worker.wait_heartbeat_seen(backend)
            before = time.time()
            s1 = await backend.open(job("req-1", "demux", [1, 2, 3]))
            s2 = await backend.open(job("req-2", "demux", [4, 5, 6]))
            await backend._nc.publish(token_subject(s.gateway_id, "req-1"), b"{not json")  # dropped, logged
            out1, out2 = await asyncio.gather(drain(s1), drain(s2))
            assert [u.token_ids for u in out1] == [[1], [2], [3]] and out1[-1].finish_reason == "stop"
            assert [u.token_ids for u in out2] == [[4], [5], [6]] and out2[-1].finish_reason == "stop"
            sent = {j.request_id: j for j in worker.jobs}
            assert sent["req-1"].reply_subject == token_subject("gw-test", "req-1")
            assert sent["req-1"].prompt_token_ids == [1, 2, 3] and sent["req-1"].sampling.max_tokens == 8
            assert sent["req-1"].model == "demux" and before <= sent["req-1"].created_at <= time.time()
            await s1.aclose()
            await s2.aclose()
            assert backend._streams == {}
        await backend.close()

    run(scenario())


def test_cancel_reaches_workers(checkpoint, nats_url, redis_url):
    async def scenario() -> None:
        backend = await started(settings(checkpoint, nats_url, redis_url, "cancel"))
        async with FakeWorker(nats_url, "cancel", script=lambda j: []) as worker:
            # core NATS: a cancel published before the worker's subscription reached the server is not
            # delivered; cancels are idempotent, so send again until one arrives
            while not worker.cancels:
                await backend.cancel("req-9")
                await asyncio.sleep(0.2)
            assert set(worker.cancels) == {"req-9"}
        await backend.close()

    run(scenario())


@pytest.mark.parametrize(
    ("model", "script", "expected"),
    [
        ("silent", lambda j: [], "no first token within 0.3 s"),
        ("stalled", lambda j: [TokensEvent(j.request_id, 0, 0, [7])], "no progress within 0.3 s"),
    ],
)
def test_deadlines_end_the_request_and_cancel_it(checkpoint, nats_url, redis_url, model, script, expected):
    async def scenario() -> None:
        s = settings(checkpoint, nats_url, redis_url, model, first_token_timeout_s=0.3, request_timeout_s=0.3)
        backend = await started(s)
        async with FakeWorker(nats_url, model, script=script) as worker:
            await worker.wait_heartbeat_seen(backend)
            updates = await drain(await backend.open(job("req-slow", model, [1])))
            assert updates[-1].failed and updates[-1].status == 504 and expected in updates[-1].error
            while not worker.cancels:
                await asyncio.sleep(0.02)
            assert worker.cancels == ["req-slow"]
        await backend.close()

    run(scenario())


def test_readiness_and_503(checkpoint, nats_url, redis_url):
    async def scenario() -> None:
        backend = await started(settings(checkpoint, nats_url, redis_url, "ready"))
        assert await backend.readiness() == (False, "no live worker serves model 'ready'")
        with pytest.raises(BackendUnavailable, match="no live worker"):
            await backend.open(job("req-1", "ready", [1]))
        assert backend._streams == {}
        async with FakeWorker(nats_url, "ready", role="prefill") as prefill:
            await asyncio.sleep(0.3)
            ok, reason = await backend.readiness()
            assert not ok and "no live decode worker" in reason
            async with FakeWorker(nats_url, "ready", role="decode") as decode_worker:
                await decode_worker.wait_heartbeat_seen(backend)
                assert await backend.readiness() == (True, "live workers for ready: 1 prefill, 1 decode")
            assert prefill.jobs == []
        await backend.close()

        dead_redis = f"redis://127.0.0.1:{free_port()}/0"
        backend = await started(settings(checkpoint, nats_url, dead_redis, "ready"))
        ok, reason = await backend.readiness()
        assert not ok and reason.startswith("Redis does not answer")
        await backend.close()

    run(scenario())


def test_nats_down_is_503_and_close_does_not_hang(checkpoint, redis_url):
    async def scenario() -> None:
        backend = NatsBackend(settings(checkpoint, f"nats://127.0.0.1:{free_port()}", redis_url, "down"))
        await backend.start()
        assert await backend.readiness() == (False, "not connected to NATS yet")
        with pytest.raises(BackendUnavailable, match="not connected to NATS"):
            await backend.open(job("req-1", "down", [1]))
        await asyncio.wait_for(backend.close(), 5)

    run(scenario())


@contextlib.contextmanager
def worker_thread(nats_url: str, model: str, role: str = "mixed", waiting_tokens: int = 0) -> Iterator[None]:
    """A FakeWorker on its own event loop (the TestClient runs the app on another one)."""
    stop = threading.Event()
    up = threading.Event()

    async def main() -> None:
        async with FakeWorker(nats_url, model, role, waiting_tokens=waiting_tokens):
            up.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert up.wait(10), "fake worker did not start"
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def test_app_over_nats(checkpoint, nats_url, redis_url):
    tokenizer = Tokenizer(checkpoint)
    with worker_thread(nats_url, "app"), TestClient(create_app(settings(checkpoint, nats_url, redis_url, "app"))) as c:
        deadline = time.monotonic() + 10
        while (r := c.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"model": "app", "prompt": "héllo", "max_tokens": 20})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0] | {"logprobs": None} == {
            "index": 0,
            "text": "héllo",  # the fake worker echoes the prompt
            "finish_reason": "stop",
            "logprobs": None,
        }
        assert r.json()["usage"]["completion_tokens"] == len(tokenizer.encode("héllo"))
        r = c.post(
            "/v1/chat/completions",
            json={"model": "app", "messages": [{"role": "user", "content": "é"}], "stream": True},
        )
        payloads = [p.removeprefix("data: ") for p in r.text.split("\n\n") if p]
        assert payloads[-1] == "[DONE]"
        text = "".join(json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1])
        assert text == "user\né\nassistant\n"  # the templated prompt, echoed; special tokens are not printed


def test_ttft_admission_refuses_what_the_backlog_makes_miss(checkpoint, nats_url, redis_url):
    """Both workers report 20 s of queued prompts (heartbeats): with admission_ttft_refuse on, a request is refused
    before dispatch with 429, Retry-After (the backlog's predicted time to clear below the target) and the OpenAI
    error shape, and counted; with it off, the same request is accepted and answered."""
    backlog = int(20 * DEFAULT_PREFILL_TOKENS_PER_S)
    path = PrefillPathSettings(prefill_path_live_calibration=False)  # the documented defaults: 20 s of backlog
    body = {"model": "ttft", "prompt": "hello", "max_tokens": 4}
    labels = {"model_name": "ttft", "role": "gateway", "reason": "ttft_slo"}
    with worker_thread(nats_url, "ttft", "prefill", backlog), worker_thread(nats_url, "ttft", "decode", backlog):
        for refuse in (True, False):
            s = settings(checkpoint, nats_url, redis_url, "ttft", path=path, admission_ttft_refuse=refuse)
            with TestClient(create_app(s)) as c:
                deadline = time.monotonic() + 10
                while (r := c.get("/ready")).status_code != 200:
                    assert time.monotonic() < deadline, r.text
                    time.sleep(0.05)
                before = REGISTRY.get_sample_value("pdserve:requests_rejected_total", labels) or 0.0
                r = c.post("/v1/completions", json=body)
                after = REGISTRY.get_sample_value("pdserve:requests_rejected_total", labels) or 0.0
                if refuse:
                    assert r.status_code == 429, r.text
                    retry = int(r.headers["retry-after"])
                    assert 20 - path.ttft_slo_ms / 1e3 - 1 <= retry <= 20 - path.ttft_slo_ms / 1e3 + 1
                    error = r.json()["error"]
                    assert error["type"] == "rate_limit_error" and error["code"] == 429
                    assert "time-to-first-token target" in error["message"]
                    assert after == before + 1
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == "hello"  # the fake worker echoes the prompt
                    assert after == before
