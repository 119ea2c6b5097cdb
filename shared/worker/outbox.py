"""Token events leave a worker through one queue and one publisher task, so a request's events keep their order
(the engine thread's outputs and the loop's own events — taken, queued, failed — interleave in one sequence)."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

from shared.messages import TokenEvent, encode

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, TokenEvent]] = asyncio.Queue()

    def emit(self, subject: str, event: TokenEvent) -> None:
        """Queue a token event for publishing (callable from the loop without awaiting)."""
        self.queue.put_nowait((subject, event))

    def empty(self) -> bool:
        return self.queue.empty()

    async def sent(self) -> None:
        """Until every event emitted so far has been handed to the connection (published in order before anything
        the caller publishes next on it)."""
        await self.queue.join()

    async def publish_forever(self, nc: Client) -> None:
        while True:
            subject, event = await self.queue.get()
            try:
                await nc.publish(subject, encode(event))
            except Exception as exc:  # the gateway's deadline turns a lost event into a clear error
                log.warning("publishing tokens for %s failed: %s", event.request_id, exc)
            finally:
                self.queue.task_done()
