"""NATS and JetStream plumbing shared by every service: connect, the jobs stream, job consumers.

Jobs go through one JetStream stream with work-queue retention: each message is delivered to one
consumer and deleted once acked. Every worker of a role shares one durable pull consumer per model, so
workers fetch jobs only when they have room (capacity-gated load balancing), and a job whose worker
dies unacked is redelivered after `ack_wait`.
"""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared.messages import JOBS_STREAM, JOBS_SUBJECTS
from shared.settings import CommonSettings

log = logging.getLogger(__name__)


async def connect(settings: CommonSettings, name: str) -> NATS:
    """A client of settings.nats_url (with its credentials and TLS options) that reconnects forever: a NATS
    restart pauses services, it does not kill them."""

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to NATS", name)

    async def on_error(exc: Exception) -> None:  # one line per failed attempt, not a traceback
        log.warning("%s: NATS connection error: %s", name, exc)

    return await nats.connect(
        settings.nats_url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )


async def ensure_jobs_stream(js: JetStreamContext) -> None:
    """Create the jobs stream if missing (idempotent: every service calls it at start)."""
    config = StreamConfig(
        name=JOBS_STREAM,
        subjects=[JOBS_SUBJECTS],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=3600.0,  # a job nobody took within an hour is stale: its client gave up long ago
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def job_consumer(
    js: JetStreamContext, subject: str, ack_wait_s: float = 30.0, max_deliver: int = 5
) -> JetStreamContext.PullSubscription:
    """The shared durable pull consumer for `subject` (one per role and model)."""
    durable = subject.replace(".", "-")
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        filter_subject=subject,
    )
    return await js.pull_subscribe(subject, durable=durable, stream=JOBS_STREAM, config=config)
