"""What the fault scenarios share (tests/test_faults.py, and benchmarks/reliability.py which runs the same
scenarios under more load): concurrent streaming requests against a stack, the verdict on each request,
a watch on the token events that says who holds which request, and the checks that must hold after
every fault (block accounting sound, no KV held, no `pd:*` key left).

A request's verdict:
  - completed: HTTP 200, every position streamed once (one chunk per token, as many as usage says, as many
    as asked for under ignore_eos), a finish reason, [DONE];
  - failed cleanly: an OpenAI-shaped error, before the stream (4xx/5xx body) or inside it (an error event,
    then [DONE]);
  - lost: anything else — a dropped connection, a stream cut short, a hang past the client's timeout,
    duplicated or missing positions.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise

import httpx
import nats

from services.local.cluster_state import wait_settled
from services.local.stack import Stack
from shared.messages import FailedEvent, FinishedEvent, TakenEvent, TokenEvent, TokensEvent, decode_event
from tests.e2e_support import scraped_total

CLIENT_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    prompt: str
    max_tokens: int
    status: int | None = None
    pieces: list[str] = field(default_factory=list)  # one per streamed token
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() when each piece came
    started: float = field(default_factory=time.monotonic)  # when the request was sent
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # the error the gateway reported
    done: bool = False  # [DONE] arrived
    exception: str | None = None  # the transport failed (connection dropped, timeout)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def longest_gap_s(self) -> float:
        """The stream's stall: the longest wait between two of its tokens (0 with fewer than two)."""
        return max((b - a for a, b in pairwise(self.arrivals)), default=0.0)

    @property
    def verdict(self) -> str:
        if self.exception is None and self.error is not None and (self.status != 200 or self.done):
            return "failed_cleanly"
        complete = (
            self.status == 200
            and self.done
            and self.exception is None
            and self.finish_reason in ("length", "stop")
            and len(self.pieces) == self.completion_tokens
            and (self.finish_reason != "length" or self.completion_tokens == self.max_tokens)
        )
        return "completed" if complete else "lost"


class Progress:
    """Streamed-token counts of the requests in flight, which a scenario waits on before striking."""

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.ended = [False] * n
        self._changed = threading.Condition()

    def bump(self, i: int, ended: bool = False) -> None:
        with self._changed:
            self.counts[i] += not ended
            self.ended[i] |= ended
            self._changed.notify_all()

    def wait(self, predicate: Callable[[Progress], bool], timeout_s: float = 60.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self), timeout_s):
                raise TimeoutError(f"progress never got there: counts {self.counts}, ended {self.ended}")


def stream_completion(
    url: str, prompt: str, max_tokens: int, progress: Progress | None = None, i: int = 0, extra: dict | None = None
) -> Outcome:
    """One streaming completion (greedy, ignore_eos, with usage, and `extra` body fields), read to its end."""
    out = Outcome(prompt, max_tokens)
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}} | (extra or {})  # fmt: skip
    try:
        with (
            httpx.Client(timeout=CLIENT_TIMEOUT_S) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as resp,
        ):
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = json.loads(resp.read())["error"]["message"]
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                elif chunk.get("usage") and not chunk["choices"]:
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                else:
                    choice = chunk["choices"][0]
                    out.pieces.append(choice["text"])
                    out.arrivals.append(time.monotonic())
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if progress is not None:
                        progress.bump(i)
    except Exception as exc:  # the verdict says lost
        out.exception = f"{type(exc).__name__}: {exc}"
    finally:
        if progress is not None:
            progress.bump(i, ended=True)
    return out


class Load:
    """`prompts` streamed concurrently, one thread each; `results()` waits for every outcome."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, extra: dict | None = None) -> None:
        self.progress = Progress(len(prompts))
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures: list[Future[Outcome]] = [
            self._pool.submit(stream_completion, url, p, max_tokens, self.progress, i, extra)
            for i, p in enumerate(prompts)
        ]

    def results(self, timeout_s: float = CLIENT_TIMEOUT_S + 30) -> list[Outcome]:
        try:
            return [f.result(timeout=timeout_s) for f in self._futures]
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


class SteadyLoad:
    """`clients` client loops, each streaming one request after another (the prompts in turn) until `stop()`: a
    closed-loop load that runs across an event (a rolling restart). `outcomes` holds (start, end, outcome) of every
    request, times monotonic."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, clients: int) -> None:
        self.outcomes: list[tuple[float, float, Outcome]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url, prompts, max_tokens, i), daemon=True)
                         for i in range(clients)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def _loop(self, url: str, prompts: list[str], max_tokens: int, client: int) -> None:
        n = client
        while not self._stopping.is_set():
            began = time.monotonic()
            outcome = stream_completion(url, prompts[n % len(prompts)], max_tokens)
            with self._lock:
                self.outcomes.append((began, time.monotonic(), outcome))
            n += 1

    def completed_by(self, when: float) -> int:
        with self._lock:
            return sum(end <= when and o.verdict == "completed" for _, end, o in self.outcomes)

    def stop(self, timeout_s: float = CLIENT_TIMEOUT_S + 30) -> list[tuple[float, float, Outcome]]:
        """Let every client finish the request it is in, then stop; every request's (start, end, outcome)."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
        with self._lock:
            return list(self.outcomes)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0-100) of `values` (not empty): p99 of a few streams is their maximum."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def stall_percentiles(outcomes: list[Outcome]) -> tuple[float, float] | None:
    """p50 and p99 of the streams' stalls (each one's longest gap between two tokens) over those that streamed
    two tokens or more; None if none did."""
    stalls = [o.longest_gap_s for o in outcomes if len(o.arrivals) >= 2]
    return (percentile(stalls, 50), percentile(stalls, 99)) if stalls else None


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    verdicts = Counter(o.verdict for o in outcomes)
    return {"sent": len(outcomes), "completed": verdicts["completed"],
            "failed_cleanly": verdicts["failed_cleanly"], "lost": verdicts["lost"]}  # fmt: skip


class EventWatch:
    """Every TokenEvent on the stack's NATS, from a thread of its own: who announced, tokened, queued what."""

    def __init__(self, nats_url: str) -> None:
        self.events: list[TokenEvent] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(nats_url)), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("could not subscribe to the token events")

    async def _run(self, nats_url: str) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(nats_url.split(","))  # one URL, or a cluster's, comma-separated

        async def on_event(msg) -> None:
            with self._lock:
                self.events.append(decode_event(msg.data))

        await nc.subscribe("pd.tokens.>", cb=on_event)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def snapshot(self) -> list[TokenEvent]:
        """Every event seen so far, in arrival order."""
        with self._lock:
            return list(self.events)

    def taken_without_token(self, worker_prefix: str) -> set[str]:
        """Requests a worker announced (took) and has published no token for yet."""
        with self._lock:
            events = list(self.events)
        taken = {e.request_id for e in events if e.worker_id.startswith(worker_prefix) and isinstance(e, TakenEvent)}
        tokened = {e.request_id for e in events if isinstance(e, TokensEvent | FinishedEvent | FailedEvent)}
        return taken - tokened

    def holders(self) -> dict[str, str]:
        """Request id → the worker whose event about it came last, for requests not finished."""
        with self._lock:
            events = list(self.events)
        last: dict[str, str] = {}
        for e in events:
            if isinstance(e, FinishedEvent | FailedEvent):
                last[e.request_id] = ""
            elif e.request_id not in last or last[e.request_id]:
                last[e.request_id] = e.worker_id
        return {rid: worker for rid, worker in last.items() if worker}

    def wait_for(self, predicate: Callable[[EventWatch], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError("the awaited token events never came")
            time.sleep(0.002)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


def settled(stack: Stack, timeout_s: float = 60.0) -> dict[str, object]:
    """Wait until the stack has left nothing behind (services/local/cluster_state.py: idle workers with sound block
    accounting and no KV held, no `pd:*` key; KV leases bound how long that takes); returns the last heartbeats
    and keys seen. Raises AssertionError with what is still wrong."""
    beats, keys, problems = wait_settled(stack.nats_url, stack.redis_url, timeout_s)
    assert not problems, "; ".join(problems)
    return {"heartbeats": beats, "keys": keys}


def gateway_metric(stack: Stack, name: str, **labels: str) -> float:
    return scraped_total(f"{stack.url}/metrics", name, **labels)
