"""services.local.infra: the local nats-server / redis-server helpers, restarted for real."""

from __future__ import annotations

import asyncio

import nats
import pytest
from redis.asyncio import Redis

from services.local.infra import start_nats, start_redis


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_nats_restart_keeps_jetstream_state(kill):
    server = start_nats()
    try:
        asyncio.run(_publish(server.url))
        old_pid = server.proc.pid
        server.restart(kill=kill)
        assert server.proc.pid != old_pid and server.proc.poll() is None
        assert asyncio.run(_read_back(server.url)) == b"survives"
    finally:
        server.stop()
    assert server.proc.poll() is not None


async def _publish(url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="RESTART", subjects=["restart.>"])
    await js.publish("restart.one", b"survives")
    await nc.close()


async def _read_back(url: str) -> bytes:
    nc = await nats.connect(url)
    try:
        msg = await nc.jetstream().get_last_msg("RESTART", "restart.one")
        return msg.data
    finally:
        await nc.close()


def test_redis_restart_listens_on_the_same_port():
    server = start_redis()
    try:
        server.restart(kill=True)
        assert asyncio.run(_ping(server.url))
    finally:
        server.stop()


async def _ping(url: str) -> bool:
    client = Redis.from_url(url)
    try:
        return await client.ping()
    finally:
        await client.aclose()
