"""The replicated control plane's pieces against real servers (services/local/replicated.py): a 3-node
nats-server cluster and a Redis primary + replica under 3 Sentinels.

  - the services' streams are made at 3 replicas, and a service configured for fewer never scales them down;
  - bus.publish_durably outlasts the death of the stream's leader (the publish waits out the election) and stores
    a retried message once (its Nats-Msg-Id);
  - a worker's job feed that cannot bind (the cluster has lost its quorum) keeps trying, and binds once it is back;
  - the services' Redis client (shared/redis_client.py with redis_sentinels) follows a failover: while the primary
    is gone its commands fail fast, never hang, and then reach the promoted replica; the killed primary, restarted,
    becomes the new primary's replica.
"""

from __future__ import annotations

import asyncio
import signal
import time

import nats
import pytest
from redis import Redis

from services.local.replicated import create_streams, start_nats_cluster, start_redis_sentinels
from shared import bus
from shared.messages import CANCELS_STREAM, JOBS_STREAM
from shared.redis_client import redis_client
from shared.settings import GatewaySettings, from_env
from shared.worker.job_feed import JobFeed

pytestmark = pytest.mark.slow  # each waits out an election or a failover: about 30 s in all on 2 cores


@pytest.fixture(scope="module")
def cluster():
    cluster = start_nats_cluster("pdserve", "cluster-pw")
    try:
        create_streams(cluster.url, 3)
        yield cluster
    finally:
        for node in cluster.nodes:
            node.stop()


def node(cluster, name: str):
    return next(n for n in cluster.nodes if n.name == name)


async def connected(cluster):
    return await nats.connect(cluster.url.split(","), reconnect_time_wait=0.2, max_reconnect_attempts=-1)


def test_streams_are_replicated_and_never_scaled_down(cluster):
    async def check() -> None:
        nc = await connected(cluster)
        js = nc.jetstream()
        try:
            await bus.ensure_streams(js, 1)  # a service left at the default, beside an R3 deployment
            for name in (JOBS_STREAM, CANCELS_STREAM):
                info = await js.stream_info(name)
                assert info.config.num_replicas == 3, name
                assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()

    asyncio.run(check())


def test_a_durable_publish_outlasts_the_stream_leaders_death(cluster):
    async def check() -> float:
        nc = await connected(cluster)
        js = nc.jetstream()
        try:
            subject = "pd.jobs.prefill.durable-test"
            before = (await js.stream_info(JOBS_STREAM)).state.messages
            await bus.publish_durably(js, subject, b"job-1")
            await bus.publish_durably(js, subject, b"job-1")  # a retry of the same message: stored once
            assert (await js.stream_info(JOBS_STREAM)).state.messages == before + 1
            leader = node(cluster, (await js.stream_info(JOBS_STREAM)).cluster.leader)
            leader.proc.send_signal(signal.SIGKILL)
            leader.proc.wait(10)
            started = time.monotonic()
            ack = await bus.publish_durably(js, subject, b"job-2")  # no leader until the others elect one
            took = time.monotonic() - started
            assert ack.stream == JOBS_STREAM and not ack.duplicate
            assert (await js.stream_info(JOBS_STREAM)).state.messages == before + 2
            await js.purge_stream(JOBS_STREAM, subject=subject)
            leader.restart()
            return took
        finally:
            await nc.close()

    took = asyncio.run(check())
    assert took < bus.PUBLISH_DEADLINE_S


def test_a_job_feed_binds_once_the_cluster_has_its_quorum_again(cluster):
    async def check() -> None:
        nc = await connected(cluster)
        try:
            feed = JobFeed(nc.jetstream(), "pd.jobs.prefill.bind-test", ack_wait_s=5.0)
            lost = [node(cluster, "nats-1"), node(cluster, "nats-2")]
            for server in lost:  # no quorum: no stream or consumer can be made
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait(10)
            binding = asyncio.ensure_future(feed.bind())
            await asyncio.sleep(2.0)
            assert not binding.done()  # still trying, not given up
            for server in lost:
                server.restart()
            consumer = await asyncio.wait_for(binding, 60)
            assert (await consumer.consumer_info()).config.ack_wait == 5.0
        finally:
            await nc.close()

    asyncio.run(check())


def test_the_sentinel_client_follows_a_failover():
    plane = start_redis_sentinels("redis-pw")
    try:
        settings = from_env(
            GatewaySettings,
            {"PDSERVE_REDIS_URL": "redis://unused:1/0", "PDSERVE_REDIS_PASSWORD": "redis-pw",
             "PDSERVE_REDIS_SENTINELS": plane.addresses},
        )  # fmt: skip
        old = plane.primary()
        assert old is not None and old.name == "redis-0"

        async def follow() -> tuple[float, float]:
            client = redis_client(settings, socket_timeout=2.0, socket_connect_timeout=1.0)
            try:
                await client.set("pd:test", "before")
                assert await client.get("pd:test") == b"before"
                old.proc.send_signal(signal.SIGKILL)
                old.proc.wait(10)
                killed, slowest = time.monotonic(), 0.0
                while True:
                    started = time.monotonic()
                    try:
                        await client.set("pd:test", "after")
                        break
                    except Exception:  # refused, or no primary known yet: at once, not after a hang
                        slowest = max(slowest, time.monotonic() - started)
                        assert time.monotonic() - killed < 30, "no new primary within 30 s"
                        await asyncio.sleep(0.05)
                assert await client.get("pd:test") == b"after"
                return time.monotonic() - killed, slowest
            finally:
                await client.aclose()

        failover_s, slowest_failure_s = asyncio.run(follow())
        new = plane.primary()
        assert new is not None and new is not old
        assert slowest_failure_s < 3.0  # each command in the gap failed fast
        assert failover_s < 30
        old.restart()  # as the supervisor does: back as the new primary's replica
        with Redis(old.host, old.port, password="redis-pw") as client:
            assert client.info("replication")["role"] == "slave"
    finally:
        for server in reversed(plane.servers):
            server.stop()
