"""A worker group switches role as a whole: a TP = 2 group (two processes) and a single worker, each a real
WorkerHost, over real nats-server and redis-server. The group starts as a prefill worker and hands a request's KV
(each rank its heads) to the single decode worker; switched to decode it computes a request of its own; with the
single worker switched to prefill, the group pulls a request's KV into both its ranks; both switched back, the
group serves KV pulls again (its ranks' servers set up anew). Every request gives the single engine's greedy
tokens, each position once, and nothing is left held or registered."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.gateway.ordering import TokenOrder
from services.local.infra import start_nats, start_redis
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.messages import (
    DecodeJob,
    FinishedEvent,
    PrefillJob,
    Role,
    Sampling,
    SwitchOutcome,
    TokenEvent,
    decode_event,
    encode,
    prefill_subject,
    routed_decode_subject,
)
from shared.parallel.group_engine import start_group
from shared.role_control import request_switch
from shared.settings import WorkerRole, WorkerSettings
from shared.worker.host import WorkerHost
from tests.e2e_support import kv_keys
from tests.integration.test_role_switch_host import roles, until

pytestmark = pytest.mark.slow  # a worker group: a follower rank spawned (make test-slow)

MODEL = "rs-group"
SECRET = "role-switch-group-test-secret"
PROMPT = list(range(30, 70))
MAX_TOKENS = 16


def config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(str(model_dir), max_model_len=256, num_kv_blocks=64, threads=1,
                        scheduler=SchedulerConfig(max_num_seqs=4), **kw)  # fmt: skip


def settings(servers, worker_id: str, role: WorkerRole, engine: EngineConfig) -> WorkerSettings:
    nats_url, redis_url = servers
    return WorkerSettings(role=role, engine=engine, worker_id=worker_id, model_name=MODEL, nats_url=nats_url,
                          redis_url=redis_url, cluster_secret=SECRET, metrics_port=None, drain_timeout_s=5)  # fmt: skip


@pytest.fixture(scope="module")
def servers():
    nats_server, redis_server = start_nats(), start_redis()
    yield nats_server.url, redis_server.url
    nats_server.stop()
    redis_server.stop()


def test_a_tp2_group_switches_between_prefill_and_decode_with_its_ranks(model_dir, servers):
    reference = Engine.build(config(model_dir)).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    group = start_group(config(model_dir, tp=2))
    nats_url, redis_url = servers
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        g = WorkerHost(settings(servers, "G", WorkerRole.PREFILL, config(model_dir, tp=2)), roles,
                       engine=group.engine, group=group)  # fmt: skip
        s = WorkerHost(settings(servers, "S", WorkerRole.DECODE, config(model_dir)), roles,
                       engine=Engine.build(config(model_dir)))  # fmt: skip
        running = [asyncio.create_task(h.run()) for h in (g, s)]
        nc = await nats.connect(nats_url)
        js = nc.jetstream()

        async def served(rid: str, subject: str, job) -> tuple[list[int], set[str]]:
            """Publish the job; → the tokens assembled as the gateway does, and who sent events."""
            events: list[TokenEvent] = []

            async def on_event(msg) -> None:
                events.append(decode_event(msg.data))

            sub = await nc.subscribe(job.reply_subject, cb=on_event)
            try:
                await js.publish(subject, encode(job))
                await until(lambda: any(isinstance(e, FinishedEvent) for e in events), 60, f"the end of {rid}")
            finally:
                await sub.unsubscribe()
            order = TokenOrder()
            for e in events:
                order.push(e)
            return order.tokens, {e.worker_id for e in events if e.worker_id}

        def prefill_job(rid: str) -> PrefillJob:
            return PrefillJob(rid, MODEL, PROMPT, sampling, f"pd.tokens.gw.{rid}")

        async def switch(host: WorkerHost, worker_id: str, role: Role) -> None:
            result = await request_switch(nc, worker_id, role, SECRET, timeout_s=60)
            assert result.outcome is SwitchOutcome.SWITCHED and host.role is role, result

        try:
            await until(lambda: g.worker.taking_jobs.is_set() and s.worker.taking_jobs.is_set(), 120, "the workers")
            # the group prefills, each rank serves its heads; S pulls them
            assert await served("r1", prefill_subject(MODEL), prefill_job("r1")) == (reference, {"G", "S"})
            await switch(g, "G", Role.DECODE)
            local = DecodeJob("r2", MODEL, PROMPT, [], sampling, "pd.tokens.gw.r2", prefill_here=True)
            assert await served("r2", routed_decode_subject(MODEL, "G"), local) == (reference, {"G"})
            await switch(s, "S", Role.PREFILL)
            # S prefills, the group's ranks pull their heads from it
            assert await served("r3", prefill_subject(MODEL), prefill_job("r3")) == (reference, {"G", "S"})
            await switch(s, "S", Role.DECODE)
            await switch(g, "G", Role.PREFILL)  # its ranks serve KV again (handlers set up anew)
            assert await served("r4", prefill_subject(MODEL), prefill_job("r4")) == (reference, {"G", "S"})
            assert g.state.switches == 2 and s.state.switches == 2
            await until(lambda: not g.worker.load.requests and not s.worker.load.requests, 30, "idle engines")
            for h in (g, s):
                assert h.worker.load.free_blocks == h.worker.load.total_blocks, h.settings.worker_id
            assert kv_keys(redis_url) == []
        finally:
            for h in (g, s):
                h.stop()
            await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
            await nc.close()

    try:
        asyncio.run(scenario())
    finally:
        group.close()
