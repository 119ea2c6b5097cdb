"""Decode-side reuse with the real worker runtime: two DecodeWorkers on the tiny engine (prefix cache on), a real
nats-server, the gateway's KV routing index. A decode worker binds its own queue (`pd.jobs.decode.<model>.<worker>`)
and takes from it; the blocks of what it decoded are announced by its runtime, so the gateway names it for a prompt
that starts with them; draining, it hands the jobs waiting in its own queue back to the shared decode queue, where
the other decode worker takes them.

The jobs are local-path decode jobs (prefill_here: computed where taken), so no prefill worker or KV pull is
involved: what is under test is where decode jobs go."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.decode.worker import DecodeWorker
from services.gateway.backend import GenerationJob
from services.gateway.kv_routing import KvRouting
from services.gateway.nats_backend import NatsBackend
from services.local.infra import free_port, start_nats
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.messages import (
    DecodeJob,
    FinishedEvent,
    Sampling,
    decode_event_or_drop,
    encode,
    routed_decode_subject,
)
from shared.settings import GatewaySettings, WorkerRole, WorkerSettings

MODEL = "dr-workers"
PROMPT = list(range(10, 74))  # 4 blocks of 16
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    yield server.url
    server.stop()


def worker(model_dir, nats_url: str, worker_id: str) -> DecodeWorker:
    config = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4),
        enable_prefix_caching=True, prefix_cache_namespace=MODEL,
    )  # fmt: skip
    settings = WorkerSettings(
        role=WorkerRole.DECODE, engine=config, worker_id=worker_id, model_name=MODEL, nats_url=nats_url,
        cluster_secret="s" * 16,
        redis_url=f"redis://127.0.0.1:{free_port()}/0", metrics_port=None, drain_timeout_s=20,
    )  # fmt: skip
    return DecodeWorker(settings, engine=Engine.build(config))


async def until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def job(rid: str) -> DecodeJob:
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return DecodeJob(rid, MODEL, PROMPT, [], sampling, f"pd.tokens.gw.{rid}", prefill_here=True)


async def served_by(nc, js, subject: str, decode_job: DecodeJob) -> set[str]:
    """Publish the job to `subject` and wait for its end: → the workers that sent its events."""
    workers: set[str] = set()
    done = asyncio.Event()

    async def on_event(msg) -> None:
        event = decode_event_or_drop(msg.data, msg.subject)
        if event is not None:
            workers.add(event.worker_id)
            if isinstance(event, FinishedEvent):
                done.set()

    sub = await nc.subscribe(decode_job.reply_subject, cb=on_event)
    try:
        await js.publish(subject, encode(decode_job))
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await sub.unsubscribe()
    return workers


def test_decode_workers_take_their_own_queue_announce_and_hand_it_back_when_draining(model_dir, nats_url):
    async def scenario() -> None:
        d1, d2 = worker(model_dir, nats_url, "d1"), worker(model_dir, nats_url, "d2")
        running = [asyncio.create_task(w.run()) for w in (d1, d2)]
        gw = NatsBackend(GatewaySettings(model_name=MODEL, nats_url=nats_url, gateway_id="gw-dw", worker_ttl_s=2.0))
        await gw.start()
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        try:
            routing = gw.routing
            assert isinstance(routing, KvRouting)
            await until(lambda: routing.sync.in_step("d1") and routing.sync.in_step("d2"))

            # its own queue: taken by d1 alone, and the blocks it computed announced
            assert await served_by(nc, js, routed_decode_subject(MODEL, "d1"), job("r1")) == {"d1"}
            await until(lambda: len(routing.index.held("d1")) >= 4)
            serving = gw.workers.serving(MODEL, time.monotonic())
            request = GenerationJob("r2", MODEL, PROMPT + [5, 6], Sampling(max_tokens=MAX_TOKENS))
            assert routing.route_decode(request, serving) == "d1"  # the prompt's blocks are d1's

            # busy, then draining: the job waiting in its own queue goes back to the shared one, d2 takes it
            d1.has_room = lambda: False  # type: ignore[method-assign]
            await asyncio.sleep(1.2)  # its fetches in flight (started with room) have expired
            waiting = asyncio.create_task(served_by(nc, js, routed_decode_subject(MODEL, "d1"), job("r3")))
            await asyncio.sleep(0.5)
            d1.stop()
            assert await waiting == {"d2"}
            await asyncio.wait_for(running[0], 30)  # and it finished draining
        finally:
            await nc.close()
            await gw.close()
            for w in (d1, d2):
                w.stopping.set()
            await asyncio.gather(*running, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 120))
