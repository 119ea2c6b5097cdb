"""KV-aware routing with the real worker runtime: two MixedWorkers on the tiny engine (their prefix cache a fake
with the engine's prefix-cache API, FakePrefixEngine's methods on the real engine), a real nats-server, the
gateway's NatsBackend. The runtime announces the blocks and binds its own queue; the gateway routes a prompt to the
worker holding it, which computes it; a worker that drains hands a job routed to it back to the shared queue,
where the other worker takes it without a move."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.backend import GenerationJob
from services.gateway.kv_routing import KvRouting
from services.gateway.nats_backend import NatsBackend
from services.local.infra import free_port, start_nats
from services.mixed.worker import MixedWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.messages import Sampling
from shared.prefix_hash import block_hashes, root_hash
from shared.settings import GatewaySettings, WorkerSettings
from shared.telemetry import metrics
from tests.prefix_engine import FakePrefixEngine

MODEL = "kvr-workers"
PROMPT = list(range(10, 74))  # 4 blocks of 16


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    yield server.url
    server.stop()


def worker(model_dir, nats_url: str, worker_id: str) -> tuple[MixedWorker, FakePrefixEngine]:
    config = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    engine = Engine.build(config)
    cache = FakePrefixEngine()
    engine.prefix_cache_events = cache.prefix_cache_events  # type: ignore[attr-defined]
    engine.prefix_cache_hashes = cache.prefix_cache_hashes  # type: ignore[attr-defined]
    settings = WorkerSettings(
        engine=config, worker_id=worker_id, model_name=MODEL, nats_url=nats_url,
        redis_url=f"redis://127.0.0.1:{free_port()}/0", metrics_port=None, drain_timeout_s=20,
    )  # fmt: skip
    return MixedWorker(settings, engine=engine), cache


async def until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def request(rid: str) -> GenerationJob:
    return GenerationJob(rid, MODEL, PROMPT, Sampling(max_tokens=4, temperature=0.0, ignore_eos=True))


async def collect(stream) -> list[int]:
    tokens = []
    async for update in stream:
        assert not update.failed, update.error
        tokens += update.token_ids
    return tokens


def test_real_workers_announce_take_routed_jobs_and_hand_them_back_when_draining(model_dir, nats_url):
    async def scenario() -> None:
        (w1, cache1), (w2, _) = worker(model_dir, nats_url, "w1"), worker(model_dir, nats_url, "w2")
        running = [asyncio.create_task(w.run()) for w in (w1, w2)]
        gw = NatsBackend(GatewaySettings(model_name=MODEL, nats_url=nats_url, gateway_id="gw-w", worker_ttl_s=2.0))
        await gw.start()
        try:
            routing = gw.routing
            assert isinstance(routing, KvRouting)
            await until(lambda: routing.sync.in_step("w1") and routing.sync.in_step("w2"))
            cache1.cache(*block_hashes(PROMPT, 16, root_hash(MODEL)))  # w1's engine caches the prompt
            await until(lambda: len(routing.index.held("w1")) == 4)  # announced by the runtime

            before = metrics.PREFILL_ROUTES.labels(MODEL, "gateway", "prefix")._value.get()
            stream = await gw.open(request("r1"))
            assert stream.queued_for == "w1"
            assert len(await asyncio.wait_for(collect(stream), 30)) == 4
            assert stream.holder == "w1" and stream.migrations == 0  # w1 took it from its own queue
            assert metrics.PREFILL_ROUTES.labels(MODEL, "gateway", "prefix")._value.get() == before + 1

            w1.has_room = lambda: False  # type: ignore[method-assign]  # busy: the next routed job waits
            await asyncio.sleep(1.2)  # its fetches in flight (started with room) have expired
            stream = await gw.open(request("r2"))
            assert stream.queued_for == "w1"
            await asyncio.sleep(0.5)
            w1.stop()  # drains: the job waiting in its own queue goes back to the shared queue
            assert len(await asyncio.wait_for(collect(stream), 30)) == 4
            assert stream.holder == "w2" and stream.migrations == 0  # taken by w2, nothing moved
            await until(lambda: "w1" not in routing.index.workers())  # its draining beat took it out
            await asyncio.wait_for(running[0], 30)  # and it finished draining
        finally:
            await gw.close()
            for w in (w1, w2):
                w.stopping.set()
            await asyncio.gather(*running, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 120))
