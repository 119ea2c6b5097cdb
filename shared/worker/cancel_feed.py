"""Every Cancel published from the moment a worker starts, each read once — including those published while
the worker was disconnected from NATS.

Why a JetStream stream and not core NATS: a core subscription loses whatever is published while the client
is away (a NATS restart, a network blip), and a lost cancel leaves a request's work and KV in place until
their lease or deadline. Cancels go into the PD_CANCELS stream (shared/bus.py: limits retention, kept
CANCEL_RETENTION_S); each worker reads it through its own ephemeral pull consumer, starting after the stream's
last message at start (old cancels are not its business), and remembers the sequence of the last cancel read:
after a reconnect — or any error — it makes a fresh consumer that starts right after it. Nothing is acked
(AckPolicy.NONE): every worker reads every cancel, and a restart of the worker starts afresh anyway.
Re-sending from the gateway until acknowledged would need the gateway to know which workers exist and track
acks per worker; the stream gives the same guarantee with NATS doing the bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.messages import CANCEL_WILDCARD, CANCELS_STREAM

log = logging.getLogger(__name__)
FETCH_BATCH = 256
FETCH_TIMEOUT_S = 1.0
RETRY_S = 0.5
INACTIVE_S = 60.0  # the server deletes a consumer left behind (this worker died or moved to a new one)


class CancelFeed:
    """Reads PD_CANCELS from where it left off and hands each message to `on_message`."""

    def __init__(self, nc: NATS, on_message: Callable[[Msg], Awaitable[None]]) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.on_message = on_message
        self.next_seq: int | None = None  # the stream sequence to read next; None until started

    async def start(self, from_seq: int | None = None) -> None:
        """Begin after the stream's last message (the stream must exist: bus.ensure_cancels_stream), or at
        `from_seq`: where the feed of the role this worker switched from stopped (none is missed in between)."""
        if from_seq is not None:
            self.next_seq = from_seq
            return
        info = await self.js.stream_info(CANCELS_STREAM)
        self.next_seq = info.state.last_seq + 1

    async def run(self) -> None:
        """Read forever: a fresh consumer after each reconnect or error, from `next_seq` on."""
        while True:
            reconnects = self.nc.stats["reconnects"]
            try:
                sub = await self._subscribe()
            except Exception as exc:  # NATS away, or JetStream not ready after a restart: try again
                log.debug("subscribing to cancels failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_S)
                continue
            try:
                await self._read(sub, reconnects)
            except Exception as exc:
                log.info("reading cancels failed (%s); resuming from sequence %s", exc, self.next_seq)
                await asyncio.sleep(RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _subscribe(self):
        info = await self.js.stream_info(CANCELS_STREAM)
        if self.next_seq is None:
            self.next_seq = info.state.last_seq + 1
        elif info.state.last_seq + 1 < self.next_seq:  # the stream was lost and made anew: all of it is new
            self.next_seq = max(1, info.state.first_seq)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.next_seq,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=INACTIVE_S,
            # as many replicas as the stream (an ephemeral consumer is R1 unless told): on a cluster, the loss of
            # the node that holds it does not cut this worker off its cancels
            num_replicas=info.config.num_replicas,
        )
        return await self.js.pull_subscribe(CANCEL_WILDCARD, stream=CANCELS_STREAM, config=config)

    async def _read(self, sub, reconnects: int) -> None:
        """Fetch until the client has reconnected (its consumer may be gone with the server's restart)."""
        while self.nc.stats["reconnects"] == reconnects:
            try:
                msgs = await sub.fetch(batch=FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                self.next_seq = msg.metadata.sequence.stream + 1
                try:
                    await self.on_message(msg)
                except Exception:  # one bad cancel must not stop the ones after it
                    log.exception("handling a cancel on %s failed", msg.subject)
