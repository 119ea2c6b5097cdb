"""A worker's connections: NATS, its JetStream context and Redis. Made together by Worker.run() (nothing is
connected before it), closed together when the worker shuts down."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from redis.asyncio import Redis

CLOSE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Connections:
    nc: NATS
    js: JetStreamContext
    redis: Redis

    async def close(self) -> None:
        """Close NATS (close, not drain: draining can wait ~30 s on a dead peer; the pending publishes get a
        second to leave) and Redis. Bounded: when the servers died with the supervisor (its children get SIGTERM
        together), closing must not keep the worker from exiting."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.flush(), 1.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)
