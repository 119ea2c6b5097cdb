"""The gateway's test harness: an in-process fake backend that answers as workers would (tokens, logprobs,
finish reasons, failures), the settings it runs under, SSE and error-shape checks, and a real uvicorn server."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import httpx
import uvicorn

from services.gateway.backend import BackendUnavailable, GenerationJob, Update
from shared.messages import Logprob
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

REPLY = "héllo 世界 🙂!"  # byte-level tokens: é, 世, 界 and 🙂 are each split across 2-4 tokens
MODEL = "demo"
CONTEXT = 2048  # the tiny demo checkpoint's max_position_embeddings
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


class FakeStream:
    def __init__(self, backend: FakeBackend, updates: Iterator[Update]) -> None:
        self._backend = backend
        self._updates = updates

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Update:
        await asyncio.sleep(self._backend.delay_s)
        update = next(self._updates, None)
        if update is None:
            raise StopAsyncIteration
        return update

    async def aclose(self) -> None:
        self._backend.closed += 1


def fake_logprob(token: int, k: int) -> Logprob:
    """A made-up logprob for `token` that a worker could have sent: the token first among k alternatives."""
    return Logprob(-0.25, [token, *range(k - 1)][:k], [-0.25 - i for i in range(k)])


class FakeBackend:
    """Answers every request with the tokens of `reply` (+ EOS, finish "stop"), or its first max_tokens
    (finish "length"); `endless` repeats them and never finishes. `fail` replaces the updates after
    `fail_after` tokens. Thread-safe enough to be watched from the test thread."""

    def __init__(self, tokenizer: Tokenizer, tokens_per_update: int = 1, delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.reply = REPLY
        self.tokens_per_update = tokens_per_update
        self.delay_s = delay_s
        self.endless = False
        self.fail: Update | None = None
        self.fail_after = 0
        self.unavailable: str | None = None
        self.cached_tokens = 0  # what the first update says the prefix cache served
        self.ready = (True, "1 prefill, 1 decode")
        self.jobs: list[GenerationJob] = []
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()
        self.closed = 0

    def reply_ids(self) -> list[int]:
        return self.tokenizer.encode(self.reply)

    def _script(self, job: GenerationJob) -> Iterator[Update]:
        ids = self.reply_ids()
        if self.endless:
            yield from (Update([t]) for t in itertools.cycle(ids))
        if self.fail is not None:
            yield from (Update([t]) for t in ids[: self.fail_after])
            yield self.fail
            return
        limit = job.sampling.max_tokens
        ids, reason = (
            (ids[:limit], "length") if len(ids) >= limit else (ids + [self.tokenizer.eos_token_ids[0]], "stop")
        )
        n = self.tokens_per_update
        groups = [ids[i : i + n] for i in range(0, len(ids), n)] or [[]]  # max_tokens 0: score only
        k = job.sampling.logprobs
        lps = [[fake_logprob(t, k) for t in g] if k is not None else [] for g in groups]
        k = job.sampling.prompt_logprobs
        prompt = [fake_logprob(t, k) for t in job.prompt_token_ids[1:]] if k is not None else []
        cached = self.cached_tokens
        yield from (
            Update(g, logprobs=lp, prompt_logprobs=prompt if i == 0 else [], cached_tokens=cached if i == 0 else 0)
            for i, (g, lp) in enumerate(zip(groups[:-1], lps, strict=False))
        )
        first = len(groups) == 1
        yield Update(
            groups[-1], reason, logprobs=lps[-1], prompt_logprobs=prompt if first else [], cached_tokens=cached * first
        )

    async def open(self, job: GenerationJob) -> FakeStream:
        if self.unavailable:
            raise BackendUnavailable(self.unavailable)
        self.jobs.append(job)
        return FakeStream(self, self._script(job))

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.cancel_seen.set()

    async def readiness(self) -> tuple[bool, str]:
        return self.ready

    async def close(self) -> None:
        pass


def settings_for(checkpoint, **overrides) -> GatewaySettings:
    return GatewaySettings(model=str(checkpoint), model_name=MODEL, max_body_bytes=64 << 10, **overrides)


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing: LF only, `data: ` lines, blank-line separated."""
    assert "\r" not in body
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def stream_chunks(body: str) -> list[dict]:
    payloads = sse_events(body)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def assert_error(response: httpx.Response, status: int, param=mock.ANY) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    return body["error"]


@contextmanager
def serve(app) -> Iterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port, in a thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
