"""A worker's side of a job queue: the durable pull consumer it binds to, the ack_wait in force on it, and
the progress reports that keep JetStream from redelivering the jobs in hand while the worker is alive. A worker
has one per queue it takes from: the shared queue of its role, and a prefill (or mixed) worker its own too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import bus
from shared.worker.ledger import JobMessage

log = logging.getLogger(__name__)
BIND_RETRY_S = 0.5


class JobFeed:
    def __init__(
        self, js: JetStreamContext, subject: str, ack_wait_s: float, inactive_threshold_s: float | None = None
    ) -> None:
        self._js, self._subject = js, subject
        self._inactive_threshold_s = inactive_threshold_s  # a worker's own queue: deleted once it is long gone
        self.wanted_ack_wait_s = ack_wait_s  # job_ack_wait_s: what a consumer created by this worker gets
        self.ack_wait_s = ack_wait_s  # the consumer's, once bound (it may have been created with another)
        self._consumer: JetStreamContext.PullSubscription | None = None

    async def bind(self) -> JetStreamContext.PullSubscription:
        """Bind to the queue's shared durable consumer (creating it if needed) and learn its ack_wait. Retried until
        it succeeds: NATS may be restarting, or a cluster electing the stream's leader (a node died), and a worker
        that gave up here would go on beating without ever taking a job."""
        failures = 0
        while True:
            try:
                self._consumer = await bus.job_consumer(self._js, self._subject, ack_wait_s=self.wanted_ack_wait_s,
                                                        inactive_threshold_s=self._inactive_threshold_s)  # fmt: skip
                break
            except Exception as exc:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "binding to the job queue %s failed (%s); retrying", self._subject, exc)
                await asyncio.sleep(BIND_RETRY_S)
        await self._learn_ack_wait(self._consumer)
        return self._consumer

    async def _learn_ack_wait(self, consumer: JetStreamContext.PullSubscription) -> None:
        """The shared consumer keeps the ack_wait it was created with (JetStream does not change it when a worker
        binds with another): progress is reported by the one in force."""
        try:
            ack_wait = (await consumer.consumer_info()).config.ack_wait
        except Exception as exc:
            log.warning("could not read the job consumer's ack_wait (%s); assuming job_ack_wait_s", exc)
            return
        if ack_wait and abs(ack_wait - self.wanted_ack_wait_s) > 0.01:
            log.warning(
                "the job consumer's ack_wait is %g s, not job_ack_wait_s=%g s (it was created with it; delete the "
                "consumer to change it): progress is reported by %g s",
                ack_wait,
                self.wanted_ack_wait_s,
                ack_wait,
            )
        self.ack_wait_s = ack_wait or self.wanted_ack_wait_s

    async def report_progress(self, in_hand: Callable[[], Iterable[JobMessage | Msg]]) -> None:
        """Forever: every third of ack_wait, tell JetStream each message `in_hand()` names is still being worked on."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for msg in in_hand():
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def hand_back(self, to_subject: str) -> None:
        """Forever (a draining worker's own queue): move every job waiting here to the queue `to_subject`, where
        another worker takes it (its TakenEvent makes that worker the holder: the request does not wait for this
        one to die). Each is published there before it is acked here: a failure leaves it here, for the
        gateway to move once this worker is gone."""
        while self._consumer is None:  # a drain that began before the queue was bound
            await asyncio.sleep(0.1)
        while True:
            try:
                msgs = await self._consumer.fetch(batch=16, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:
                log.warning("handing back routed jobs failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await bus.publish_durably(self._js, to_subject, msg.data, msg.headers or None)
                    await msg.ack()
                except Exception as exc:
                    log.warning("could not hand back a routed job (%s); the gateway moves it", exc)
