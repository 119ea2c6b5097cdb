"""What a running deployment reports about itself, read from outside: the workers' latest heartbeats (NATS)
and the KV location keys in Redis — each worker's role now (roles may switch while they run: `describe`), and
whether a run left anything behind (blocks in use, KV held, requests still running, keys). Tests, the fault
scenarios and the soak benchmark check their runs with it."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
from redis import Redis

from shared.messages import HEARTBEAT_WILDCARD, Heartbeat

KEYS = "pd:*"  # every key pdserve writes (shared/kv/registry.py names them): none may outlive its request


def heartbeats(nats_url: str, seconds: float = 2.5) -> dict[str, Heartbeat]:
    """The latest heartbeat of every worker heard within `seconds` (workers beat about once a second)."""

    async def collect() -> dict[str, Heartbeat]:
        nc = await nats.connect(nats_url.split(","))  # one URL, or a cluster's, comma-separated
        seen: dict[str, Heartbeat] = {}

        async def on_beat(msg) -> None:
            beat = msgspec.json.decode(msg.data, type=Heartbeat)
            seen[beat.worker_id] = beat

        await nc.subscribe(HEARTBEAT_WILDCARD, cb=on_beat)
        await asyncio.sleep(seconds)
        await nc.drain()
        return seen

    return asyncio.run(collect())


def describe(beats: dict[str, Heartbeat]) -> list[str]:
    """One line per worker, by id: its role now (and the one it is switching to), its group and load."""
    lines = []
    for worker_id, b in sorted(beats.items()):
        role = f"{b.role} → {b.switching_to} (switching)" if b.switching_to else str(b.role)
        state = " draining" if b.draining and not b.switching_to else ""
        group = f" [{b.parallel}]" if b.parallel else ""
        used = b.total_blocks - b.free_blocks
        lines.append(f"{worker_id}: {role}{state}{group}, {b.running} running, {b.waiting} waiting, "
                     f"{used}/{b.total_blocks} KV blocks used, {b.held_kv} held")  # fmt: skip
    return lines


def kv_keys(redis_url: str) -> list[str]:
    """pdserve's keys in Redis (`pd:*`), sorted."""
    client = Redis.from_url(redis_url)
    try:
        return sorted(k.decode() for k in client.scan_iter(match=KEYS))
    finally:
        client.close()


def leftovers(beats: dict[str, Heartbeat], keys: list[str]) -> list[str]:
    """What a finished run left behind, one line each; empty when every worker is idle with sound block
    accounting and no KV held, and no key is left."""
    problems = [
        f"{b.worker_id}: {what}"
        for b in beats.values()
        for what, bad in (
            (f"block accounting broken: {b.integrity_error}", b.integrity_error is not None),
            (f"holds the KV of {b.held_kv} requests", b.held_kv),
            (f"{b.running} running, {b.waiting} waiting", b.running or b.waiting),
            (f"{b.total_blocks - b.free_blocks} KV blocks in use", b.free_blocks != b.total_blocks),
        )
        if bad
    ]
    return problems + ([f"{len(keys)} {KEYS} keys left: {keys[:5]}"] if keys else [])


def wait_settled(nats_url: str, redis_url: str, timeout_s: float) -> tuple[dict[str, Heartbeat], list[str], list[str]]:
    """Wait (KV leases may have to run out) until nothing is left behind, at most timeout_s: the last heartbeats
    and keys seen, and what is still left (empty: settled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats, keys = heartbeats(nats_url, seconds=1.2), kv_keys(redis_url)
        problems = leftovers(beats, keys)
        if not problems or time.monotonic() > deadline:
            return beats, keys, problems
        time.sleep(0.5)
