"""Role switching with the real worker host (shared/worker/host.py), real nats-server and redis-server, and two
worker processes' worth of hosts in this process on the tiny engine: A starts as a decode worker, B is one.

A decodes a request routed to its own queue; switched to prefill with finish_s 0, it hands that request on to the
prefill queue (its tokens so far kept), serves as a prefill worker — it takes the very job it handed on, computes
prompt + tokens, samples the next token and hands the KV on — and B pulls that KV and decodes to the end: the
positions, assembled by the gateway's own ordering (TokenOrder), are the single engine's greedy tokens, each once.
Then the refusals (the last decode or prefill worker, a lock held by another caller, a forged order, the same role,
a worker that does not exist), and A switched back to decode, with nothing left held anywhere."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats
import pytest
from redis.asyncio import Redis

from services.gateway.ordering import TokenOrder
from services.local.infra import start_nats, start_redis
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.messages import (
    DecodeJob,
    FinishedEvent,
    QueuedEvent,
    Role,
    Sampling,
    SwitchOutcome,
    TakenEvent,
    TokenEvent,
    decode_event,
    encode,
    routed_decode_subject,
)
from shared.role_control import live_workers, request_switch, role_lock, switch_role
from shared.settings import WorkerRole, WorkerSettings
from shared.telemetry import metrics
from shared.worker.host import WorkerHost
from tests.e2e_support import kv_keys

MODEL = "rs-host"
SECRET = "role-switch-host-test-secret"
PROMPT = list(range(20, 60))
MAX_TOKENS = 40


def roles(role: Role):
    from services.decode.worker import DecodeWorker
    from services.mixed.worker import MixedWorker
    from services.prefill.worker import PrefillWorker

    return {Role.PREFILL: PrefillWorker, Role.DECODE: DecodeWorker, Role.MIXED: MixedWorker}[role]


@pytest.fixture(scope="module")
def servers():
    nats_server, redis_server = start_nats(), start_redis()
    yield nats_server.url, redis_server.url
    nats_server.stop()
    redis_server.stop()


def host(model_dir, servers, worker_id: str, role: WorkerRole) -> WorkerHost:
    config = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    nats_url, redis_url = servers
    settings = WorkerSettings(
        role=role, engine=config, worker_id=worker_id, model_name=MODEL, nats_url=nats_url, redis_url=redis_url,
        cluster_secret=SECRET, metrics_port=None, drain_timeout_s=5,
    )  # fmt: skip
    return WorkerHost(settings, roles, engine=Engine.build(config))


async def until(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def switches(frm: str, to: str, outcome: str) -> float:
    return metrics.ROLE_SWITCHES.labels(MODEL, frm, to, outcome)._value.get()


def test_a_decode_worker_switches_to_prefill_and_back_handing_its_request_on(model_dir, servers):
    reference = Engine.build(EngineConfig(str(model_dir), max_model_len=256)).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    nats_url, redis_url = servers

    async def scenario() -> None:
        a, b = host(model_dir, servers, "A", WorkerRole.DECODE), host(model_dir, servers, "B", WorkerRole.DECODE)
        running = [asyncio.create_task(h.run()) for h in (a, b)]
        nc = await nats.connect(nats_url)
        redis = Redis.from_url(redis_url)
        events: list[TokenEvent] = []

        async def on_event(msg) -> None:
            events.append(decode_event(msg.data))

        try:
            await until(lambda: a.worker.taking_jobs.is_set() and b.worker.taking_jobs.is_set(), what="the workers")
            reply = "pd.tokens.gw.r1"
            await nc.subscribe(reply, cb=on_event)
            sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            job = DecodeJob("r1", MODEL, PROMPT, [], sampling, reply, prefill_here=True)  # computed where taken
            await nc.jetstream().publish(routed_decode_subject(MODEL, "A"), encode(job))
            await until(lambda: len([e for e in events if getattr(e, "token_ids", None)]) >= 3, what="tokens")

            before = switches("decode", "prefill", "switched")
            result = await request_switch(nc, "A", Role.PREFILL, SECRET, finish_s=0)
            assert result.outcome is SwitchOutcome.SWITCHED, result
            assert (result.role, result.previous_role, result.handed_on) == (Role.PREFILL, Role.DECODE, 1)
            assert a.role is Role.PREFILL and a.state.switches == 1
            assert switches("decode", "prefill", "switched") == before + 1

            await until(lambda: any(isinstance(e, FinishedEvent) for e in events), what="the end of r1")
            order = TokenOrder()
            for e in events:
                order.push(e)
            assert order.finished and order.tokens == reference  # every position once, the engine's tokens
            handed = next(e for e in events if isinstance(e, QueuedEvent) and e.worker_id == "A" and e.attempt == 0)
            assert 3 <= handed.seq < MAX_TOKENS  # handed on mid-stream
            takers = [(e.worker_id, e.attempt, e.seq) for e in events if isinstance(e, TakenEvent)]
            assert ("A", 1, handed.seq) in takers  # A, a prefill worker now, recomputed it as attempt 1
            assert [e.worker_id for e in events if isinstance(e, FinishedEvent)] == ["B"]  # B decoded the rest

            # the refusals
            beats = await live_workers(nc)
            assert {b.worker_id: b.role for b in beats if b.model == MODEL} == {"A": Role.PREFILL, "B": Role.DECODE}
            unsafe = await switch_role(nc, redis, "B", Role.PREFILL, SECRET, settle_s=0)
            assert unsafe.outcome is SwitchOutcome.UNSAFE and "last live decode worker" in unsafe.detail
            unsafe = await switch_role(nc, redis, "A", Role.DECODE, SECRET, settle_s=0)
            assert unsafe.outcome is SwitchOutcome.UNSAFE and "last live prefill worker" in unsafe.detail
            assert await redis.get("pd:admin:role-lock") is None  # released after each
            async with role_lock(redis, "planner"):
                locked = await switch_role(nc, redis, "A", Role.DECODE, SECRET, lock_wait_s=0.2)
            assert locked.outcome is SwitchOutcome.LOCKED and "planner" in locked.detail
            forged = await request_switch(nc, "A", Role.DECODE, "not-the-cluster-secret!")
            assert forged.outcome is SwitchOutcome.REFUSED and "signature" in forged.detail
            same = await request_switch(nc, "A", Role.PREFILL, SECRET)
            assert same.outcome is SwitchOutcome.SAME_ROLE and same.role is Role.PREFILL
            assert (await request_switch(nc, "C", Role.DECODE, SECRET)).outcome is SwitchOutcome.UNKNOWN_WORKER
            assert a.role is Role.PREFILL and a.state.switches == 1  # none of them changed anything

            # back to decode (the raw order: the safe call refuses, as above, to leave no prefill worker); nothing
            # left held or registered
            back = await request_switch(nc, "A", Role.DECODE, SECRET)
            assert back.outcome is SwitchOutcome.SWITCHED and a.role is Role.DECODE, back
            await until(lambda: not a.worker.load.requests and not b.worker.load.requests, what="idle engines")
            for h in (a, b):
                load = h.worker.load
                assert load.free_blocks == load.total_blocks, h.settings.worker_id
                await h.worker.engine.call(lambda e: e.check_integrity())
            assert kv_keys(redis_url) == []
        finally:
            for h in (a, b):
                h.stop()
            await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
            await nc.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_a_switch_that_cannot_start_or_settle_leaves_the_old_role_serving_and_a_stop_calls_one_off(
    model_dir, servers, monkeypatch
):
    """The host's other ends: the new role's setup fails (the old role is set up again: `invalid`); what the old
    role holds does not settle in time (it serves on: `timed_out`); a stop during a switch calls it off (`stopping`,
    and the process ends)."""
    from services.decode.worker import DecodeWorker
    from services.mixed.worker import MixedWorker
    from shared.worker import host as host_module

    class StuckMixed(MixedWorker):
        stuck = False  # something in hand never settles

        def idle(self) -> bool:
            return not StuckMixed.stuck and super().idle()

    class BrokenPrefill(roles(Role.PREFILL)):  # type: ignore[misc]
        async def setup(self) -> None:
            raise RuntimeError("the KV transfer port is taken")

    kinds = {Role.MIXED: StuckMixed, Role.PREFILL: BrokenPrefill, Role.DECODE: DecodeWorker}
    monkeypatch.setattr(host_module, "SETTLE_MARGIN_S", 0.5)
    nats_url, _ = servers

    async def scenario() -> None:
        m = host(model_dir, servers, "M", WorkerRole.MIXED)
        m.roles = kinds.__getitem__
        m.worker = StuckMixed(m.settings, engine=m.worker.engine.engine)
        m.settings = dataclasses.replace(m.settings, kv=dataclasses.replace(m.settings.kv, lease_s=0.5))
        running = asyncio.create_task(m.run())
        nc = await nats.connect(nats_url)
        try:
            await until(lambda: m.worker.taking_jobs.is_set(), what="the worker")
            broken = await request_switch(nc, "M", Role.PREFILL, SECRET)
            assert broken.outcome is SwitchOutcome.INVALID and "port is taken" in broken.detail, broken
            await until(lambda: m.worker.taking_jobs.is_set() and isinstance(m.worker, StuckMixed), what="mixed again")
            assert m.role is Role.MIXED and m.state.switches == 0

            StuckMixed.stuck = True
            stuck = await request_switch(nc, "M", Role.DECODE, SECRET, finish_s=0)
            assert stuck.outcome is SwitchOutcome.TIMED_OUT and m.role is Role.MIXED, stuck
            assert not m.worker.draining and m.worker.switching_to is None  # it takes jobs again

            answer = asyncio.create_task(request_switch(nc, "M", Role.DECODE, SECRET, finish_s=0))
            await until(lambda: m.worker.switching_to is Role.DECODE, what="the switch to begin")
            m.stop()  # SIGTERM: the switch is called off, the process ends once the old role has drained
            StuckMixed.stuck = False
            assert (await answer).outcome is SwitchOutcome.STOPPING
            await asyncio.wait_for(running, 30)
            assert m.role is Role.MIXED
        finally:
            StuckMixed.stuck = False
            m.stop()
            await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 30)
            await nc.close()

    asyncio.run(scenario())
