"""Token events lost on core NATS are sent again, against a real nats-server: a worker's side (SentEvents, its
Resender, its Outbox) and a gateway's (a RequestUpdates stream fed by a token subscription, ResendAsks).

The loss is made certain by never publishing some events the worker recorded as sent (what a publish into a
restarting server, or a server with no subscription of the gateway yet, amounts to). The worker's connection runs
through a proxy the test cuts and restores, for the resend it does by itself after a reconnect."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest
from nats.aio.client import Client as NATS

from services.gateway.request_stream import Deadlines, RequestUpdates
from services.gateway.resend_asks import ResendAsks
from services.local.infra import start_nats
from shared import bus
from shared.messages import (
    FinishedEvent,
    FinishReason,
    TakenEvent,
    TokenEvent,
    TokensEvent,
    decode_event,
    token_subject,
    token_wildcard,
)
from shared.settings import WorkerSettings
from shared.worker.outbox import Outbox
from shared.worker.resend import Resender, SentEvents
from tests.nats_proxy import Proxy

MODEL = "demo"
SUBJECT = token_subject("gw", "r")


@pytest.fixture
def nats_server():
    server = start_nats()
    yield server
    server.stop()


def events() -> list[TokenEvent]:
    """A request's events from a decode worker: taken at 0, tokens 0..7, the last finishing it."""
    out: list[TokenEvent] = [TakenEvent("r", 0, 0, "d0")]
    for seq in range(8):
        if seq == 7:
            out.append(FinishedEvent("r", 0, seq, [100 + seq], "d0", finish_reason=FinishReason.LENGTH))
        else:
            out.append(TokensEvent("r", 0, seq, [100 + seq], "d0"))
    return out


class Worker:
    """The resend side of a worker: every event recorded, those not `lost` published through the outbox."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.sent = SentEvents(lambda _: True)
        self.outbox = Outbox()
        self.resender = Resender(self.sent, MODEL, self.outbox.emit, (MODEL, "decode"))
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.resender.start(self.nc)
        self.tasks = [
            asyncio.create_task(self.outbox.publish_forever(self.nc)),
            asyncio.create_task(self.resender.run(self.nc)),
        ]

    def emit(self, event: TokenEvent, lost: bool = False) -> None:
        self.sent.record(SUBJECT, event)
        if not lost:
            self.outbox.emit(SUBJECT, event)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.nc.close()


async def gateway(url: str) -> tuple[NATS, RequestUpdates, list[TokenEvent]]:
    """A gateway's connection with one request's stream, fed by the token subscription; what arrived, in order."""
    nc = await nats.connect(url)
    stream = RequestUpdates("r", Deadlines(30, 30), cancel=_no_cancel, forget=lambda _: None)
    arrived: list[TokenEvent] = []

    async def on_event(msg) -> None:
        event = decode_event(msg.data)
        arrived.append(event)
        stream.push(event)

    await nc.subscribe(token_wildcard("gw"), cb=on_event)
    await nc.flush()
    return nc, stream, arrived


async def _no_cancel(_: str) -> None:
    raise AssertionError("the request was cancelled")


async def read_all(stream: RequestUpdates, timeout_s: float) -> list[int]:
    async def read() -> list[int]:
        return [t async for u in stream for t in u.token_ids]

    return await asyncio.wait_for(read(), timeout_s)


def test_a_gateway_asks_for_the_positions_it_lacks_and_gets_each_once(nats_server):
    async def scenario():
        gw_nc, stream, arrived = await gateway(nats_server.url)
        worker = Worker(await bus.connect(WorkerSettings(nats_url=nats_server.url), "worker-test"))
        await worker.start()
        asks = ResendAsks(MODEL, lambda: [stream])
        asking = asyncio.create_task(asks.run(gw_nc))
        try:
            for event in events():
                worker.emit(event, lost=isinstance(event, TokensEvent) and event.seq in (2, 3))
            tokens = await read_all(stream, 10)
        finally:
            asking.cancel()
            await worker.stop()
            await gw_nc.close()
        return tokens, arrived

    tokens, arrived = asyncio.run(scenario())
    assert tokens == [100 + i for i in range(8)]  # every position once, in order
    resent = [e for e in arrived if isinstance(e, FinishedEvent) and e.seq == 2]
    assert resent and resent[0].token_ids == [102 + i for i in range(6)]  # from the gap on, as one event


def test_a_worker_sends_everything_again_after_it_reconnects(nats_server):
    """The worker's connection breaks and comes back; the FinishedEvent it sent meanwhile was lost. Nobody asks
    (the gateway was never away): the worker sends its requests' events again by itself."""

    async def scenario():
        gw_nc, stream, arrived = await gateway(nats_server.url)
        proxy = Proxy(nats_server.port)
        await proxy.restore()
        worker = Worker(await bus.connect(WorkerSettings(nats_url=f"nats://127.0.0.1:{proxy.port}"), "worker-test"))
        await worker.start()
        try:
            *first, last = events()
            for event in first:
                worker.emit(event)
            for _ in range(50):
                if stream.delivered == 7:
                    break
                await asyncio.sleep(0.05)
            assert stream.delivered == 7
            await proxy.cut()
            worker.emit(last, lost=True)
            await asyncio.sleep(0.3)
            assert not stream.finished  # lost, and nothing asks for it (no ResendAsks here)
            await proxy.restore()
            tokens = await read_all(stream, 10)
        finally:
            await worker.stop()
            await gw_nc.close()
        return tokens, arrived

    tokens, arrived = asyncio.run(scenario())
    assert tokens == [100 + i for i in range(8)]
    assert sum(isinstance(e, FinishedEvent) for e in arrived) == 1 and len(arrived) > 9  # resent: the end, once
