"""services.local.infra: the local nats-server / redis-server helpers, restarted for real; services.local.children:
a child dies with the process that started it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import nats
import pytest
from redis.asyncio import Redis

from services.local.children import popen_options, running
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


def test_a_child_stops_when_its_parent_is_killed():
    """A parent starts `sleep 60` with popen_options() and is SIGKILLed: the kernel's parent-death signal
    ends the sleep at once (without it the orphan would sleep on)."""
    code = ("import os, signal, subprocess; from services.local.children import popen_options; "
            "child = subprocess.Popen(['sleep', '60'], stdout=subprocess.DEVNULL, **popen_options()); "
            "print(child.pid, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                            env=os.environ | {"PYTHONPATH": os.getcwd()})  # fmt: skip
    assert parent.returncode == -9, parent.stderr
    child = int(parent.stdout)
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)


def test_only_the_main_thread_ties_children_to_its_life():
    """The parent-death signal follows the forking thread: a child started from another thread must not get it
    (it would die when that thread ends), but gets its own process group all the same."""
    assert set(popen_options()) == {"process_group", "preexec_fn"}
    from_thread: list[dict] = []
    thread = threading.Thread(target=lambda: from_thread.append(popen_options()))
    thread.start()
    thread.join()
    assert from_thread == [{"process_group": 0}]
