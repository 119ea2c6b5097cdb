"""Drive a list of BenchRequest against a server on schedule and summarize what came back.

Schedule: a request with at_s is sent at that offset from the start; the others at the offsets of the gamma
(Poisson at burstiness 1) arrival process in list order, or all at t = 0 for an infinite rate. max_concurrency
caps requests in flight with a semaphore: a request due while the cap is reached waits, so it is sent after its
scheduled time (as in vLLM, whose numbers then describe the capped load, not the rate asked for). Warm-up requests
go first, one at a time, before the clock starts, and are not recorded.

A Conversation (services.bench.prefix_workloads) arrives like one request: its first turn is sent at its offset,
and each later turn think_s after the previous turn's stream ended, with the earlier user messages and the
streamed answers as history. Its turns hold the concurrency cap only while in flight, not while thinking. A turn
that fails ends its conversation: the turns left are recorded as failed without being sent. A lone request is a
conversation of one turn that is not numbered (its record's turn stays None).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

import httpx
from tqdm import tqdm

from services.bench.arrivals import arrival_offsets, check_rate
from services.bench.client import ENDPOINT_PATHS, send
from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestRecord, check_slos, summarize
from services.bench.prefix_workloads import Conversation
from services.bench.transfer import scrape_pulls, transfer_share

BACKENDS = {"completions": "openai", "chat": "openai-chat"}  # vLLM's names for the same endpoints


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = float("inf")  # req/s; inf = all at once (bounded by max_concurrency)
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson (as vLLM)
    max_concurrency: int | None = None
    num_warmups: int = 0  # sent first, sequentially, not measured
    goodput_slos: dict[str, float] = field(default_factory=dict)  # {"ttft"|"tpot"|"e2el": ms}
    percentiles: tuple[float, ...] = (50, 90, 99)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0  # per request, for connect and for each read
    progress: bool = True  # tqdm bar
    extra_body: dict | None = None  # merged into every request body
    kv_metrics_urls: tuple[str, ...] = ()  # decode workers' /metrics: the KV pulls' share of TTFT (transfer.py)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        check_rate(self.request_rate, self.burstiness)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        check_slos(self.goodput_slos)
        if not self.percentiles or not all(0 <= p <= 100 for p in self.percentiles):
            raise ValueError(f"percentiles must be a non-empty list within [0, 100], got {self.percentiles}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


@dataclass
class BenchResult:
    config: BenchConfig
    records: list[RequestRecord]  # in the order of the requests given (a conversation's turns in turn order)
    duration_s: float  # clock start (after warm-ups) → last request finished
    summary: dict  # summarize(...) plus the run's settings (request_rate, burstiness, ..., date)

    def to_json(self, detailed: bool = False) -> dict:
        """A JSON-ready dict shaped like vLLM's result file. detailed adds per-request lists (vLLM's
        --save-detailed): input_lens, output_lens, ttfts, itls, latencies, start_times (s), kinds, errors,
        cached_tokens (None where the server sent none), turns (None outside conversations)."""
        out = dict(self.summary)
        if detailed:
            recs = self.records
            out |= {
                "input_lens": [r.prompt_len for r in recs],
                "output_lens": [r.output_tokens for r in recs],
                "ttfts": [r.ttft_s for r in recs],
                "itls": [list(r.itl_s) for r in recs],
                "latencies": [r.latency_s for r in recs],
                "start_times": [r.start_s for r in recs],
                "kinds": [r.kind for r in recs],
                "errors": [r.error for r in recs],
                "cached_tokens": [r.cached_tokens for r in recs],
                "turns": [r.turn for r in recs],
            }
        return out


Workload = Sequence[BenchRequest] | Sequence[Conversation]


def schedule(items: Workload, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offset (s) of each request or conversation's first turn, in list order: at_s where set, else the next
    arrival of the process."""
    free = [i for i, r in enumerate(items) if r.at_s is None]
    process = iter(arrival_offsets(len(free), rate, burstiness, seed))
    return [r.at_s if r.at_s is not None else next(process) for r in items]


def _turns(item: BenchRequest | Conversation) -> tuple[BenchRequest, ...]:
    return item.turns if isinstance(item, Conversation) else (item,)


async def run_benchmark(config: BenchConfig, requests: Workload) -> BenchResult:
    """Warm up, then send every request (or conversation) on schedule through one shared HTTP/1.1 client and
    wait for all. Each request's failure is recorded, never raised."""
    if not requests:
        raise ValueError("no requests to send")
    offsets = schedule(requests, config.request_rate, config.burstiness, config.seed)
    # Enough pooled connections that the client never queues a request the schedule or the cap lets through.
    connections = config.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, http2=False) as http:

        async def one(req: BenchRequest, start_ref: float, history: Sequence[tuple[str, str]] = ()) -> RequestRecord:
            return await send(http, config.base_url, config.model, config.endpoint, req, config.api_key, start_ref,
                              config.extra_body, history)  # fmt: skip

        for i in range(config.num_warmups):  # a conversation warms up with its first turn alone
            await one(_turns(requests[i % len(requests)])[0], time.perf_counter())
        pulls_before = await scrape_pulls(http, config.kv_metrics_urls)  # after the warm-ups: theirs do not count

        cap = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
        bar = tqdm(total=sum(len(_turns(r)) for r in requests), disable=not config.progress, unit="req")
        start = time.perf_counter()

        async def scheduled(item: BenchRequest | Conversation, offset: float) -> list[RequestRecord]:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if isinstance(item, Conversation):
                return await converse(item.turns, item.think_s, numbered=True)
            return await converse((item,), 0.0, numbered=False)

        async def converse(turns: tuple[BenchRequest, ...], think_s: float, numbered: bool) -> list[RequestRecord]:
            records: list[RequestRecord] = []
            history: list[tuple[str, str]] = []
            for k, turn in enumerate(turns):
                if records and not records[-1].success:
                    records.append(_not_sent(turn, k + 1, time.perf_counter() - start))
                    bar.update(1)
                    continue
                if k > 0 and think_s > 0:
                    await asyncio.sleep(think_s)
                if records:  # the client's own estimate of the prompt, in case the server sends no usage
                    prev = records[-1]
                    turn = replace(turn, prompt_len=prev.prompt_len + prev.output_tokens + turn.prompt_len)
                async with cap:
                    record = await one(turn, start, history)
                record.turn = k + 1 if numbered else None
                records.append(record)
                history.append((turn.prompt, record.generated_text))
                bar.update(1)
            return records

        # Tasks are created in send order, so requests waiting on the cap get it first-come first-served.
        order = sorted(range(len(requests)), key=offsets.__getitem__)
        tasks = {i: asyncio.create_task(scheduled(requests[i], offsets[i])) for i in order}
        try:
            await asyncio.gather(*tasks.values())
        finally:
            bar.close()
        duration = time.perf_counter() - start
        pulls_after = await scrape_pulls(http, config.kv_metrics_urls)
    records = [rec for i in range(len(requests)) for rec in tasks[i].result()]
    summary = summarize(records, duration, config.goodput_slos, config.percentiles)
    if config.kv_metrics_urls:
        summary |= transfer_share(pulls_before, pulls_after, summary)
    return BenchResult(config, records, duration, _settings(config, len(records)) | summary)


def _not_sent(turn: BenchRequest, number: int, at_s: float) -> RequestRecord:
    """The record of a turn left unsent because an earlier turn of its conversation failed."""
    return RequestRecord(turn.kind, turn.prompt_len, turn.output_len, at_s, success=False, turn=number,
                         error=f"not sent: turn {number - 1} of its conversation failed")  # fmt: skip


def _settings(config: BenchConfig, num_prompts: int) -> dict:
    """The run's settings under vLLM's result keys (request_rate "inf" as a string, as JSON has no inf)."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": BACKENDS[config.endpoint],
        "endpoint": config.endpoint,
        "model": config.model,
        "model_id": config.model,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": "inf" if math.isinf(config.burstiness) else config.burstiness,
        "max_concurrency": config.max_concurrency,
        "num_warmups": config.num_warmups,
        "goodput": dict(config.goodput_slos) or None,
        "percentiles": list(config.percentiles),
        "seed": config.seed,
    }


def run(config: BenchConfig, requests: Workload) -> BenchResult:
    """run_benchmark in a fresh event loop (asyncio.run)."""
    return asyncio.run(run_benchmark(config, requests))
