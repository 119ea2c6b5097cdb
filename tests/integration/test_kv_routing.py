"""KV-aware routing against a real nats-server: workers announce their prefix-cache blocks (the real
BlockAnnouncer over a fake engine's prefix cache), the gateway's NatsBackend indexes them and publishes a prompt
to the own queue of the worker holding its prefix — unless that worker is overloaded; a gateway that starts late
learns the blocks from snapshots; a dead worker leaves the index and the job routed to it moves to the shared
queue, where another worker serves it.

The workers are scripted (RoutedWorker): they take jobs from their own queue and the shared one as the real
runtime does, and answer each with its prompt echoed back."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest

from services.gateway.backend import GenerationJob
from services.gateway.kv_routing import KvRouting
from services.gateway.nats_backend import NatsBackend
from services.local.infra import start_nats
from shared import bus
from shared.messages import (
    JOBS_STREAM,
    FinishedEvent,
    FinishReason,
    Heartbeat,
    PrefillJob,
    Role,
    Sampling,
    TakenEvent,
    TokensEvent,
    decode,
    encode,
    heartbeat_subject,
    prefill_subject,
    routed_prefill_subject,
)
from shared.prefix_hash import block_hashes, root_hash
from shared.settings import GatewaySettings
from shared.telemetry import metrics
from shared.worker.block_announcer import BlockAnnouncer
from shared.worker.job_feed import JobFeed
from tests.prefix_engine import FakePrefixEngine

BS = 4
PROMPT = list(range(100, 164))  # 16 blocks
OTHER = list(range(500, 564))


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    yield server.url
    server.stop()


class RoutedWorker:
    """A mixed worker of `model` in outline: heartbeats (with its queued tokens and block-update number), its
    prefix cache announced by the real BlockAnnouncer, jobs taken from its own queue and the shared one (while
    `serving`), each answered with its prompt; `beating` False is a dead worker."""

    def __init__(self, nats_url: str, model: str, worker_id: str) -> None:
        self.nats_url, self.model, self.worker_id = nats_url, model, worker_id
        self.engine = FakePrefixEngine()
        self.waiting_tokens = 0
        self.beating = self.serving = True
        self.taken: list[tuple[str, PrefillJob]] = []  # (the subject it came on, the job)
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> RoutedWorker:
        self.nc = await nats.connect(self.nats_url)
        js = self.nc.jetstream()
        await bus.ensure_streams(js)
        own = await bus.job_consumer(
            js, routed_prefill_subject(self.model, self.worker_id), inactive_threshold_s=bus.OWN_QUEUE_INACTIVE_S
        )
        shared = await bus.job_consumer(js, prefill_subject(self.model))

        async def on_engine(fn):
            return fn(self.engine)

        self.announcer = BlockAnnouncer(self.nc, on_engine, self.model, self.worker_id, BS)
        await self.announcer.start()
        self._tasks = [asyncio.create_task(t) for t in (self._heartbeats(), self._serve(own), self._serve(shared))]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.nc.close()

    async def cache(self, prompt: list[int]) -> None:
        """The engine caches the prompt's full blocks, and the announcer sends them."""
        self.engine.cache(*block_hashes(prompt, BS, root_hash(self.model)))
        await self.announcer.announce()

    async def _heartbeats(self) -> None:
        while True:
            if self.beating:
                beat = Heartbeat(self.worker_id, Role.MIXED, self.model, None, block_size=BS, total_blocks=1000,
                                 waiting_tokens=self.waiting_tokens, kv_blocks_epoch=self.announcer.epoch,
                                 kv_blocks_seq=self.announcer.seq)  # fmt: skip
                await self.nc.publish(heartbeat_subject(Role.MIXED, self.worker_id), encode(beat))
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
                job = decode(msg.data, PrefillJob)
                self.taken.append((msg.subject, job))
                await msg.ack()
                r, a, w, ids = job.request_id, job.attempt, self.worker_id, job.prompt_token_ids
                done = len(job.output_token_ids)
                events = [
                    TakenEvent(r, a, done, w),
                    TokensEvent(r, a, done, ids[done:4], worker_id=w),
                    FinishedEvent(r, a, 4, [], worker_id=w, finish_reason=FinishReason.LENGTH),
                ]
                for event in events:
                    await self.nc.publish(job.reply_subject, encode(event))


async def gateway(nats_url: str, model: str, gateway_id: str) -> NatsBackend:
    backend = NatsBackend(GatewaySettings(model_name=model, nats_url=nats_url, gateway_id=gateway_id, worker_ttl_s=1.0))
    await backend.start()
    await until(lambda: backend._nc is not None)
    return backend


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def request(rid: str, model: str, prompt: list[int]) -> GenerationJob:
    return GenerationJob(rid, model, prompt, Sampling(max_tokens=4, temperature=0.0))


async def answer(backend: NatsBackend, job: GenerationJob) -> list[int]:
    stream = await backend.open(job)
    tokens = []
    async with asyncio.timeout(10):
        async for update in stream:
            assert not update.failed, update.error
            tokens += update.token_ids
    return tokens


def routes(model: str, how: str) -> float:
    return metrics.PREFILL_ROUTES.labels(model, "gateway", how)._value.get()


def in_step(backend: NatsBackend, *workers: str) -> bool:
    routing = backend.routing
    assert isinstance(routing, KvRouting)
    return all(routing.sync.in_step(w) for w in workers)


def test_a_prompt_goes_to_the_worker_holding_its_prefix_unless_it_is_overloaded(nats_url):
    model = "kvr-route"

    async def scenario() -> None:
        async with RoutedWorker(nats_url, model, "p1") as p1, RoutedWorker(nats_url, model, "p2") as p2:
            gw = await gateway(nats_url, model, "gw-a")
            try:
                await until(lambda: in_step(gw, "p1", "p2"))
                await p1.cache(PROMPT)
                await p2.cache(OTHER)
                index = gw.routing.index  # type: ignore[attr-defined]
                await until(lambda: len(index.held("p1")) == 16 and len(index.held("p2")) == 16)

                prefix_before = routes(model, "prefix")
                assert await answer(gw, request("r1", model, PROMPT)) == PROMPT[:4]
                assert [s for s, j in p1.taken if j.request_id == "r1"] == [routed_prefill_subject(model, "p1")]
                assert await answer(gw, request("r2", model, OTHER)) == OTHER[:4]
                assert [s for s, j in p2.taken if j.request_id == "r2"] == [routed_prefill_subject(model, "p2")]
                assert routes(model, "prefix") == prefix_before + 2

                # p1's queue now costs more than its cache saves: the prompt goes elsewhere (p2 holds none of
                # it, so the shared queue takes it and whoever has room serves it)
                p1.waiting_tokens = 10_000
                await asyncio.sleep(0.3)  # a beat with the new load
                shared_before = routes(model, "shared")
                assert await answer(gw, request("r3", model, PROMPT)) == PROMPT[:4]
                taken = [s for w in (p1, p2) for s, j in w.taken if j.request_id == "r3"]
                assert taken == [prefill_subject(model)] and routes(model, "shared") == shared_before + 1
                p1.waiting_tokens = 0

                # a gateway that starts now missed every update: it asks for snapshots and routes the same
                late = await gateway(nats_url, model, "gw-late")
                try:
                    await until(lambda: in_step(late, "p1", "p2"))
                    assert late.routing.index.held("p1") == index.held("p1")  # type: ignore[attr-defined]
                    await asyncio.sleep(0.3)  # p1's beats with no queue
                    assert await answer(late, request("r4", model, PROMPT)) == PROMPT[:4]
                    assert [s for s, j in p1.taken if j.request_id == "r4"] == [routed_prefill_subject(model, "p1")]
                finally:
                    await late.close()
            finally:
                await gw.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_dead_worker_leaves_the_index_and_the_job_routed_to_it_moves(nats_url):
    model = "kvr-death"

    async def scenario() -> None:
        async with RoutedWorker(nats_url, model, "p1") as p1, RoutedWorker(nats_url, model, "p2") as p2:
            gw = await gateway(nats_url, model, "gw-d")
            try:
                await until(lambda: in_step(gw, "p1", "p2"))
                await p1.cache(PROMPT)
                index = gw.routing.index  # type: ignore[attr-defined]
                await until(lambda: len(index.held("p1")) == 16)

                p1.serving = False  # hung: its own queue keeps the job
                await asyncio.sleep(0.5)  # its fetches in flight have expired
                stream = await gw.open(request("r1", model, PROMPT))
                assert stream.holder == "p1" and stream.queued_for == "p1"  # held by p1 from dispatch
                p1.beating = False  # and now dead
                collected = []

                async def collect() -> None:
                    async for update in stream:
                        assert not update.failed, update.error
                        collected.extend(update.token_ids)

                await asyncio.wait_for(collect(), 10)
                assert collected == PROMPT[:4]
                assert "p1" not in index.workers()  # out of the index as liveness declared it dead
                moved = [(s, j.attempt) for s, j in p2.taken if j.request_id == "r1"]
                assert moved == [(prefill_subject(model), 1)]  # the next attempt, from the shared queue
                assert not [j for _, j in p1.taken if j.request_id == "r1"]

                # a prompt it held goes elsewhere now: nothing live holds it
                assert await answer(gw, request("r2", model, PROMPT)) == PROMPT[:4]
                assert [s for s, j in p2.taken if j.request_id == "r2"] == [prefill_subject(model)]
            finally:
                await gw.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_draining_worker_hands_its_routed_jobs_back_to_the_shared_queue(nats_url):
    model = "kvr-drain"

    async def scenario() -> None:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            await bus.ensure_streams(js)
            own = JobFeed(js, routed_prefill_subject(model, "p1"), 30.0, bus.OWN_QUEUE_INACTIVE_S)
            await own.bind()
            shared = await bus.job_consumer(js, prefill_subject(model))
            for rid in ("r1", "r2"):
                job = PrefillJob(rid, model, [1, 2, 3], Sampling(max_tokens=4), f"pd.tokens.gw.{rid}")
                await js.publish(routed_prefill_subject(model, "p1"), encode(job), headers={"traceparent": rid})
            handing_back = asyncio.create_task(own.hand_back(prefill_subject(model)))
            try:
                moved = []
                while len(moved) < 2:
                    with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                        for msg in await shared.fetch(batch=1, timeout=0.5):
                            job = decode(msg.data, PrefillJob)
                            moved.append((job.request_id, msg.headers["traceparent"]))
                            await msg.ack()
                assert sorted(moved) == [("r1", "r1"), ("r2", "r2")]  # the trace context goes along
                # nothing left in its own queue, once the hand-back's acks (sent after each re-publish) are in
                name = routed_prefill_subject(model, "p1").replace(".", "-")
                for _ in range(100):
                    info = await js.consumer_info(JOBS_STREAM, name)
                    if info.num_pending == 0 and info.num_ack_pending == 0:
                        break
                    await asyncio.sleep(0.05)
                assert info.num_pending == 0 and info.num_ack_pending == 0, info
            finally:
                handing_back.cancel()
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
