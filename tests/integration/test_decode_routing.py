"""Routing decode jobs (decode-side reuse) against a real nats-server: decode workers announce their prefix-cache
blocks (the real BlockAnnouncer over a fake engine's cache), the gateway names the one holding the prompt on the
PrefillJob (decode_worker), the prefill worker hands the decode job to that worker's own queue and says so
(QueuedEvent.routed_to, the real queued_event). The routed worker holds the request from then on: when it dies
with the job still in its own queue, the request moves like any other, to the shared decode queue, where another
decode worker serves it. With decode_kv_reuse off, no decode job is routed.

The workers are scripted: the prefill worker answers the first token of each job, decode workers the rest."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.gateway.backend import GenerationJob
from services.gateway.kv_routing import KvRouting
from services.gateway.nats_backend import NatsBackend
from services.local.infra import start_nats
from shared import bus
from shared.messages import (
    DecodeJob,
    FinishedEvent,
    FinishReason,
    Heartbeat,
    PrefillJob,
    Role,
    Sampling,
    TakenEvent,
    TokensEvent,
    decode,
    decode_subject,
    encode,
    handed_on_subject,
    heartbeat_subject,
    prefill_subject,
    routed_decode_subject,
)
from shared.prefix_hash import block_hashes, root_hash
from shared.settings import GatewaySettings, PrefillPath, PrefillPathSettings
from shared.telemetry import metrics
from shared.worker.block_announcer import BlockAnnouncer
from shared.worker.events import queued_event
from tests.prefix_engine import FakePrefixEngine

BS = 4
PROMPT = list(range(100, 164))  # 16 blocks
ANSWER = 4  # tokens per request


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    yield server.url
    server.stop()


class ScriptedWorker:
    """A worker in outline: heartbeats while `beating`, jobs fetched from its queues while `serving`."""

    role = Role.PREFILL

    def __init__(self, nats_url: str, model: str, worker_id: str) -> None:
        self.nats_url, self.model, self.worker_id = nats_url, model, worker_id
        self.beating = self.serving = True
        self.taken: list[tuple[str, PrefillJob | DecodeJob]] = []  # (the subject it came on, the job)
        self._tasks: list[asyncio.Task] = []
        self.announcer: BlockAnnouncer | None = None

    def queues(self) -> list[str]:
        return [prefill_subject(self.model)]

    async def __aenter__(self):
        self.nc = await nats.connect(self.nats_url)
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        await self.start()
        consumers = [await bus.job_consumer(self.js, q) for q in self.queues()]
        self._tasks = [asyncio.create_task(self._heartbeats())]
        self._tasks += [asyncio.create_task(self._serve(c)) for c in consumers]
        return self

    async def start(self) -> None:
        pass

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.nc.close()

    async def _heartbeats(self) -> None:
        while True:
            if self.beating:
                a = self.announcer
                beat = Heartbeat(self.worker_id, self.role, self.model, None, block_size=BS, total_blocks=1000,
                                 free_blocks=1000, kv_blocks_epoch=a.epoch if a else "",
                                 kv_blocks_seq=a.seq if a else 0)  # fmt: skip
                await self.nc.publish(heartbeat_subject(self.role, self.worker_id), encode(beat))
            await asyncio.sleep(0.1)

    async def _serve(self, consumer) -> None:
        while True:
            if not self.serving:
                await asyncio.sleep(0.02)
                continue
            try:
                msgs = await consumer.fetch(batch=1, timeout=0.2)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                await self.handle(msg.subject, msg.data)
                await msg.ack()

    async def handle(self, subject: str, data: bytes) -> None:
        raise NotImplementedError


class Prefill(ScriptedWorker):
    """Samples the next token (the prompt's own, echoed) and hands the decode job on as the real worker does."""

    async def handle(self, subject: str, data: bytes) -> None:
        job = decode(data, PrefillJob)
        self.taken.append((subject, job))
        r, a, w, done = job.request_id, job.attempt, self.worker_id, len(job.output_token_ids)
        for event in (TakenEvent(r, a, done, w), TokensEvent(r, a, done, [job.prompt_token_ids[done]], worker_id=w)):
            await self.nc.publish(job.reply_subject, encode(event))
        going_on = DecodeJob(r, job.model, job.prompt_token_ids, [*job.prompt_token_ids[: done + 1]], job.sampling,
                             job.reply_subject, attempt=a, prefill_worker=w, kv_reuse=job.decode_kv_reuse)  # fmt: skip
        await self.js.publish(handed_on_subject(self.model, job.decode_worker), encode(going_on))
        await self.nc.publish(job.reply_subject, encode(queued_event(job, w)))


class Decode(ScriptedWorker):
    """Takes from its own decode queue and the shared one; answers the rest of the tokens."""

    role = Role.DECODE

    def queues(self) -> list[str]:
        return [routed_decode_subject(self.model, self.worker_id), decode_subject(self.model)]

    async def start(self) -> None:
        self.engine = FakePrefixEngine()

        async def on_engine(fn):
            return fn(self.engine)

        self.announcer = BlockAnnouncer(self.nc, on_engine, self.model, self.worker_id, BS)
        await self.announcer.start()

    async def cache(self, prompt: list[int]) -> None:
        self.engine.cache(*block_hashes(prompt, BS, root_hash(self.model)))
        assert self.announcer is not None
        await self.announcer.announce()

    async def handle(self, subject: str, data: bytes) -> None:
        job = decode(data, DecodeJob)
        self.taken.append((subject, job))
        r, a, w, done = job.request_id, job.attempt, self.worker_id, len(job.output_token_ids)
        events = [
            TakenEvent(r, a, done, w),
            TokensEvent(r, a, done, job.prompt_token_ids[done:ANSWER], worker_id=w),
            FinishedEvent(r, a, ANSWER, [], worker_id=w, finish_reason=FinishReason.LENGTH),
        ]
        for event in events:
            await self.nc.publish(job.reply_subject, encode(event))


async def gateway(nats_url: str, model: str, gateway_id: str, reuse: bool = True) -> NatsBackend:
    settings = GatewaySettings(model_name=model, nats_url=nats_url, gateway_id=gateway_id, worker_ttl_s=1.0,
                               decode_kv_reuse=reuse, path=PrefillPathSettings(PrefillPath.REMOTE))  # fmt: skip
    backend = NatsBackend(settings)
    await backend.start()
    await until(lambda: backend._nc is not None)
    return backend


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def request(rid: str, model: str) -> GenerationJob:
    return GenerationJob(rid, model, PROMPT, Sampling(max_tokens=ANSWER, temperature=0.0))


async def collect(stream) -> list[int]:
    tokens = []
    async with asyncio.timeout(10):
        async for update in stream:
            assert not update.failed, update.error
            tokens += update.token_ids
    return tokens


def decode_routes(model: str) -> float:
    return metrics.DECODE_ROUTES.labels(model, "gateway")._value.get()


async def ready(gw: NatsBackend, d1: Decode) -> None:
    routing = gw.routing
    assert isinstance(routing, KvRouting)
    await until(lambda: routing.sync.in_step("d1"))
    await d1.cache(PROMPT)
    await until(lambda: len(routing.index.held("d1")) == 16)


def test_the_decode_job_goes_to_the_decode_worker_holding_the_prompt(nats_url):
    model = "dr-route"

    async def scenario() -> None:
        async with (
            Prefill(nats_url, model, "p1") as p1,
            Decode(nats_url, model, "d1") as d1,
            Decode(nats_url, model, "d2") as d2,
        ):
            gw = await gateway(nats_url, model, "gw-r")
            try:
                await ready(gw, d1)
                before = decode_routes(model)
                assert await collect(await gw.open(request("r1", model))) == PROMPT[:ANSWER]
                assert [j.decode_worker for _, j in p1.taken] == ["d1"]
                assert [s for s, _ in d1.taken] == [routed_decode_subject(model, "d1")] and not d2.taken
                assert decode_routes(model) == before + 1
            finally:
                await gw.close()
            off = await gateway(nats_url, model, "gw-off", reuse=False)
            try:  # decode_kv_reuse off: the shared queue, and the decode job says not to reuse
                await until(lambda: off.routing.index.held("d1"))  # type: ignore[attr-defined]
                assert await collect(await off.open(request("r2", model))) == PROMPT[:ANSWER]
                job = next(j for _, j in p1.taken if j.request_id == "r2")
                assert job.decode_worker is None and not job.decode_kv_reuse
                took = [(s, j.kv_reuse) for w in (d1, d2) for s, j in w.taken if j.request_id == "r2"]
                assert took == [(decode_subject(model), False)]
            finally:
                await off.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_routed_decode_job_whose_worker_dies_moves(nats_url):
    model = "dr-death"

    async def scenario() -> None:
        async with (
            Prefill(nats_url, model, "p1") as p1,
            Decode(nats_url, model, "d1") as d1,
            Decode(nats_url, model, "d2") as d2,
        ):
            gw = await gateway(nats_url, model, "gw-d")
            try:
                await ready(gw, d1)
                d1.serving = False  # hung: the decode job stays in its own queue
                await asyncio.sleep(0.5)  # its fetches in flight have expired
                stream = await gw.open(request("r1", model))
                await until(lambda: p1.taken and stream.holder == "d1")  # the QueuedEvent named it
                d1.beating = False  # and now dead
                assert await collect(stream) == PROMPT[:ANSWER]
                assert not d1.taken
                moved = [(s, j.attempt) for s, j in p1.taken]
                assert moved == [(prefill_subject(model), 0), (prefill_subject(model), 1)]
                assert p1.taken[1][1].decode_worker is None  # a moved request's decode job: the shared queue
                assert [(s, j.attempt) for s, j in d2.taken] == [(decode_subject(model), 1)]
            finally:
                await gw.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
