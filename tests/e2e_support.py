"""Helpers for end-to-end tests against a running stack (real processes)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
from redis import Redis

from services.launcher import Stack, StackSpec
from shared.messages import HEARTBEAT_WILDCARD, Heartbeat


def start_stack(spec: StackSpec, log_dir: str | None = None, ready_timeout_s: float = 180) -> Stack:
    """A started stack; if it does not come up, its services' logs are printed before the error propagates."""
    stack = Stack(spec, log_dir=log_dir)
    try:
        return stack.start(ready_timeout_s=ready_timeout_s)
    except Exception:
        print(stack.logs())
        raise


def heartbeats(nats_url: str, seconds: float = 2.5) -> dict[str, Heartbeat]:
    """The latest heartbeat of every worker seen within `seconds`."""

    async def collect() -> dict[str, Heartbeat]:
        nc = await nats.connect(nats_url)
        seen: dict[str, Heartbeat] = {}

        async def on_msg(msg) -> None:
            beat = msgspec.json.decode(msg.data, type=Heartbeat)
            seen[beat.worker_id] = beat

        await nc.subscribe(HEARTBEAT_WILDCARD, cb=on_msg)
        await asyncio.sleep(seconds)
        await nc.drain()
        return seen

    return asyncio.run(collect())


def kv_keys(redis_url: str) -> list[bytes]:
    client = Redis.from_url(redis_url)
    try:
        return list(client.scan_iter(match="pd:*"))
    finally:
        client.close()
