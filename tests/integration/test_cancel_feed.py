"""Cancels reach a worker that was disconnected from NATS when they were published (shared/worker/cancel_feed.py),
against a real nats-server. The worker's connection runs through a TCP proxy the test cuts and restores, so the
cancel is published while the server is up and the worker is away — deterministically."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest

from services.local.infra import start_nats
from shared import bus
from shared.messages import Cancel, cancel_subject, decode, encode
from shared.settings import WorkerSettings
from shared.worker.cancel_feed import CancelFeed
from tests.nats_proxy import Proxy


async def _wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
def nats_server():
    server = start_nats()
    yield server
    server.stop()


def test_a_cancel_published_while_the_worker_is_disconnected_arrives_after_it_reconnects(nats_server):
    async def scenario() -> list[str]:
        proxy = Proxy(nats_server.port)
        await proxy.restore()
        worker_nc = await bus.connect(WorkerSettings(nats_url=f"nats://127.0.0.1:{proxy.port}"), "worker-test")
        gateway_nc = await nats.connect(nats_server.url)
        gateway_js = gateway_nc.jetstream()
        await bus.ensure_streams(gateway_js)
        received: list[str] = []

        async def on_message(msg) -> None:
            received.append(decode(msg.data, Cancel).request_id)

        async def cancel(rid: str) -> None:
            await gateway_js.publish(cancel_subject(rid), encode(Cancel(rid)))

        await cancel("before-start")  # not this worker's business: it starts after the stream's last message
        feed = CancelFeed(worker_nc, on_message)
        await feed.start()
        reading = asyncio.create_task(feed.run())
        try:
            await cancel("connected")
            await _wait_for(lambda: received == ["connected"])
            await proxy.cut()
            await _wait_for(lambda: not worker_nc.is_connected)
            await cancel("while-away")  # the server takes it; the worker cannot hear it now
            await asyncio.sleep(1.0)
            assert received == ["connected"]
            await proxy.restore()
            await _wait_for(lambda: worker_nc.is_connected)
            await _wait_for(lambda: "while-away" in received)
            await cancel("after")
            await _wait_for(lambda: "after" in received)
            await asyncio.sleep(0.5)  # nothing read twice after the resubscription
            return received
        finally:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            await worker_nc.close()
            await gateway_nc.close()
            await proxy.cut()

    assert asyncio.run(scenario()) == ["connected", "while-away", "after"]


def test_cancels_survive_a_nats_restart(nats_server):
    """The stream is on disk: a cancel published after a restart, before the worker is back, still arrives."""

    async def scenario() -> list[str]:
        worker_nc = await bus.connect(WorkerSettings(nats_url=nats_server.url), "worker-test")
        await bus.ensure_streams(worker_nc.jetstream())
        received: list[str] = []

        async def on_message(msg) -> None:
            received.append(decode(msg.data, Cancel).request_id)

        feed = CancelFeed(worker_nc, on_message)
        await feed.start()
        reading = asyncio.create_task(feed.run())
        try:
            await asyncio.to_thread(nats_server.restart)
            publisher = await nats.connect(nats_server.url)
            await publisher.jetstream().publish(cancel_subject("r"), encode(Cancel("r")))
            await publisher.close()
            await _wait_for(lambda: received == ["r"], 20)
            return received
        finally:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            await worker_nc.close()

    assert asyncio.run(scenario()) == ["r"]
