"""The gateway's side of the resend protocol: ask the workers for the token events its streams lack.

Token events are core NATS: those published while the bus was away (a restart, a failover) or while this gateway
was not subscribed yet (a worker back on a restarted server before it) are lost. Every worker keeps what it sent
(shared/worker/resend.py). Every ASK_TICK_S this loop asks each open stream whether it lacks events
(RequestUpdates.resend_from: a gap, nothing since the gateway got back to NATS, a silent holder) and publishes one
ResendRequest naming every such request, its attempt and the first position it lacks, on `pd.resend.<model>`:
every worker of the model hears it (the gateway need not know who sent what: a lost TakenEvent leaves it not
knowing who holds a request, and a gap at position 0 is the prefill worker's, not the holder's), and those that
sent any of the events send them again to the request's token subject. Nothing is answered otherwise: a stream
that still lacks them is asked again, less often each time, until the events come or its holder is judged dead.

It also notices each reconnect (the client's reconnect count, so a blip shorter than a tick counts too):
`reconnected_at` is when the last one happened, which the watchdog reads too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from nats.aio.client import Client as NATS

from services.gateway.request_stream import RequestUpdates
from shared.messages import RESEND_ITEMS_PER_MESSAGE, ResendItem, ResendRequest, encode, resend_subject
from shared.telemetry import metrics

log = logging.getLogger(__name__)

ASK_TICK_S = 0.1


class ResendAsks:
    def __init__(
        self, model: str, streams: Callable[[], Iterable[RequestUpdates]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.model = model
        self._streams = streams
        self._clock = clock
        self.reconnected_at: float | None = None  # when the client last reconnected (None: never since it connected)

    async def run(self, nc: NATS) -> None:
        reconnects = nc.stats["reconnects"]
        while True:
            await asyncio.sleep(ASK_TICK_S)
            if nc.stats["reconnects"] != reconnects:
                reconnects, self.reconnected_at = nc.stats["reconnects"], self._clock()
                log.info("reconnected to NATS: asking the workers for the token events sent while away")
            if not nc.is_connected:
                continue
            try:
                await self.ask(nc)
            except Exception as exc:  # NATS went away meanwhile: the next tick asks again
                log.warning("asking for lost token events failed: %s", exc)

    def wanted(self) -> list[ResendItem]:
        """Every open stream's ask due now (each one counted by its stream)."""
        items = []
        for stream in list(self._streams()):
            due = stream.resend_from(self.reconnected_at)
            if due is not None:
                position, why = due
                items.append(ResendItem(stream.request_id, stream.attempt, position))
                metrics.TOKEN_RESEND_ASKS.labels(self.model, "gateway", why).inc()
        return items

    async def ask(self, nc: NATS) -> int:
        """Publish the asks due now; returns how many requests were named."""
        items = self.wanted()
        for i in range(0, len(items), RESEND_ITEMS_PER_MESSAGE):
            await nc.publish(resend_subject(self.model), encode(ResendRequest(items[i : i + RESEND_ITEMS_PER_MESSAGE])))
        if items:  # debug: a long prefill's silent holder is asked now and then (pdserve:token_resend_asks_total)
            log.debug("asked the workers again for the token events of %d requests", len(items))
        return len(items)
