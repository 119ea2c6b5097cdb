"""NATS and JetStream plumbing shared by every service: connect, the jobs stream, job consumers.

Jobs go through one JetStream stream with work-queue retention: each message is delivered to one
consumer and deleted once acked. Every worker of a role shares one durable pull consumer per model, so
workers fetch jobs only when they have room (capacity-gated load balancing), and a job whose worker
dies unacked is redelivered after `ack_wait`. A prefill (or mixed) worker also has its own consumer, of the
jobs the gateway routed to it (KV-aware routing): those only it takes, and the gateway moves them when it dies.

On a nats-server cluster the streams are replicated (`jetstream_replicas`, 3 on three nodes) and so are their
consumers: losing a node costs a leader election (its raft timeout, seconds), not the messages. While a stream has
no leader a publish gets no answer, so messages that must not be lost (jobs, cancels) go through
`publish_durably`, which retries until the stream takes them, each retry the same message to JetStream's
duplicate detection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError

from shared.messages import CANCEL_RETENTION_S, CANCEL_WILDCARD, CANCELS_STREAM, JOBS_STREAM, JOBS_SUBJECTS
from shared.settings import CommonSettings
from shared.tls import client_context
from shared.urls import redact, split_credentials

log = logging.getLogger(__name__)


REPEAT_LOG_S = 30.0  # the same connection problem is logged again at most this often


def tls_context(settings: CommonSettings) -> ssl.SSLContext | None:
    """The NATS client's TLS context (None: no TLS). Raises ValueError naming the variable when a CA,
    certificate or key cannot be read — callers that connect in the background call it first, at start."""
    servers, _, _ = _servers_and_credentials(settings.nats_url)
    wants_tls = bool(settings.nats_tls_ca or settings.nats_tls_cert) or any(s.startswith("tls://") for s in servers)
    if not wants_tls:
        return None
    return client_context("PDSERVE_NATS_TLS", settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key)


async def connect(settings: CommonSettings, name: str) -> NATS:
    """A client of settings.nats_url that reconnects forever: a NATS restart pauses services, it does not kill
    them. Credentials: settings.nats_user / nats_password, else the URL's (a password with no user, or a user
    name alone in the URL, is a token). TLS when settings.nats_tls_ca is set or the URL is tls://; then
    credentials are never sent over a connection the server did not upgrade to TLS. Why the client is not
    connected (refused credentials, say) is logged once, then at most every REPEAT_LOG_S while it lasts, and
    answered by connection_problem(name)."""
    servers, user, password = _servers_and_credentials(settings.nats_url)
    user, password = settings.nats_user or user, settings.nats_password or password
    tls = tls_context(settings)
    problems = _ProblemLog(name)
    client = NATS()

    def guarded(secret: str) -> Callable[[], str]:
        """The secret, handed over only on a TLS connection when TLS was asked for (no downgrade)."""

        def give() -> str:
            if tls is not None and not client._server_info.get("tls_required"):  # nats-py upgrades iff this is set
                raise ConnectionError("the NATS server did not offer TLS, but TLS was asked for: credentials withheld")
            return secret

        return give

    auth: dict[str, Any] = {}
    if user is not None and password is not None:
        auth = {"user": guarded(user), "password": guarded(password)}
    elif (token := user or password) is not None:
        auth = {"token": guarded(token)}

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        problems.solved()
        log.info("%s: reconnected to NATS", name)

    async def on_error(exc: Exception) -> None:  # one line now and then, never a traceback per attempt
        problems.report(exc)

    login = f"as {user}" if user and password else "with a token" if user or password else "without credentials"
    tls_note = ", TLS" if tls else ""
    log.info("%s: connecting to NATS at %s (%s%s)", name, redact(",".join(servers)), login, tls_note)
    await client.connect(
        servers,
        name=name,
        max_reconnect_attempts=-1,
        # nats-py annotates int, but only ever sleeps for it or adds it to a time: half a second works
        reconnect_time_wait=0.5,  # pyright: ignore[reportArgumentType]
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        tls=tls,
        **auth,
    )
    problems.solved()
    return client


def connection_problem(name: str) -> str | None:
    """Why the NATS client `name` (of this process) is not connected, from its last failed attempt; None when
    it is, or has not failed yet."""
    return _problems.get(name)


_problems: dict[str, str] = {}  # client name → its current connection problem


class _ProblemLog:
    """One client's failed attempts: each distinct problem logged at most every REPEAT_LOG_S, and a refusal
    (credentials, TLS) not displaced by the connection reset that follows it (the server hangs up after
    refusing, and nats-py reports that too on some attempts)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.logged_at: dict[str, float] = {}  # problem → when it was last logged
        self.repeats = 0  # failed attempts not logged since the last line
        self.refused = False  # the current problem is a refusal

    def report(self, exc: Exception) -> None:
        if self.refused and isinstance(exc, ConnectionResetError | BrokenPipeError | nats.errors.UnexpectedEOF):
            self.repeats += 1
            return
        problem, self.refused = _explain(exc)
        now = time.monotonic()
        if now - self.logged_at.get(problem, -REPEAT_LOG_S) >= REPEAT_LOG_S:
            again = f" ({self.repeats} more failed attempts since the last report)" if self.repeats else ""
            log.warning("%s: cannot connect to NATS: %s; retrying%s", self.name, problem, again)
            self.logged_at[problem], self.repeats = now, 0
        else:
            self.repeats += 1
        _problems[self.name] = problem

    def solved(self) -> None:
        _problems.pop(self.name, None)
        self.logged_at.clear()
        self.repeats, self.refused = 0, False


def _servers_and_credentials(url: str) -> tuple[list[str], str | None, str | None]:
    """settings.nats_url (one URL or a comma-separated list) → the servers without user info, and the first
    user name and password found in them."""
    servers, user, password = [], None, None
    for one in (u.strip() for u in url.split(",") if u.strip()):
        bare, u, p = split_credentials(one)
        servers.append(bare)
        user, password = user or u, password or p
    return servers, user, password


def _explain(exc: Exception) -> tuple[str, bool]:
    """One line saying what went wrong and what to check; and whether the server refused us (credentials or
    TLS), as opposed to being unreachable."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
        hint = "check PDSERVE_NATS_USER and PDSERVE_NATS_PASSWORD"
        return f"the server refused the credentials ({text}): {hint}", True
    if isinstance(exc, ssl.SSLError) or "did not offer TLS" in text:
        hint = "check PDSERVE_NATS_TLS_CA (and _CERT / _KEY where clients are verified)"
        return f"TLS failed ({text}): {hint}", True
    return f"{type(exc).__name__}: {text}", False


async def ensure_jobs_stream(js: JetStreamContext, replicas: int = 1) -> None:
    """Create the jobs stream if missing (idempotent: every service calls it at start)."""
    config = StreamConfig(
        name=JOBS_STREAM,
        subjects=[JOBS_SUBJECTS],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=3600.0,  # a job nobody took within an hour is stale: its client gave up long ago
        num_replicas=replicas,
    )
    await _ensure_stream(js, config)


async def ensure_cancels_stream(js: JetStreamContext, replicas: int = 1) -> None:
    """Create the cancels stream if missing (idempotent). Cancels are kept (limits retention, CANCEL_RETENTION_S)
    so that a worker that was disconnected when one was published still reads it after reconnecting; every
    worker reads every cancel (shared/worker/cancel_feed.py), so nothing is removed on delivery."""
    config = StreamConfig(
        name=CANCELS_STREAM,
        subjects=[CANCEL_WILDCARD],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,  # survives a NATS restart, as the sequence numbers workers resume from do
        max_age=CANCEL_RETENTION_S,
        max_msgs=100_000,
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
    )
    await _ensure_stream(js, config)


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Every stream the services use: jobs and cancels, each at `replicas` (settings.jetstream_replicas)."""
    await ensure_jobs_stream(js, replicas)
    await ensure_cancels_stream(js, replicas)


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to `config` — but never to fewer replicas than it has: a
    service started with the default (1) beside an R3 deployment must not scale its streams down."""
    assert config.name is not None
    try:
        await js.add_stream(config)
    except BadRequestError:  # it exists, configured otherwise
        have = (await js.stream_info(config.name)).config.num_replicas or 1
        await js.update_stream(dataclasses.replace(config, num_replicas=max(have, config.num_replicas or 1)))


PUBLISH_DEADLINE_S = 30.0  # past a cluster's leader election (nats-server's raft timeout is 4-9 s) with room
PUBLISH_ATTEMPT_S = 2.0  # one attempt's wait for the stream's ack
PUBLISH_RETRY_S = 0.25  # pause after an attempt that failed at once (no stream leader answered)


async def publish_durably(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    headers: dict[str, str] | None = None,
    deadline_s: float = PUBLISH_DEADLINE_S,
) -> PubAck:
    """Publish into a stream and wait until the stream has it, retrying for up to `deadline_s` while nobody
    answers (the stream's leader died and its replicas are electing another; the client is reconnecting) or the
    ack is lost. Every attempt carries the same Nats-Msg-Id, a digest of subject and payload, so a stored
    message whose ack was lost is not stored twice (JetStream's duplicate window, 2 minutes): the same bytes on
    the same subject within it are one message. Raises the last error past the deadline, or at once for a
    refusal that retrying cannot change (an API error other than 503)."""
    msg_id = hashlib.blake2b(subject.encode() + b"\0" + payload, digest_size=16).hexdigest()
    headers = (headers or {}) | {"Nats-Msg-Id": msg_id}
    deadline, retries = time.monotonic() + deadline_s, 0
    while True:
        left = deadline - time.monotonic()
        try:
            return await js.publish(subject, payload, timeout=max(0.1, min(PUBLISH_ATTEMPT_S, left)), headers=headers)
        except (NoStreamResponseError, nats.errors.TimeoutError, APIError) as exc:
            if isinstance(exc, APIError) and exc.code != 503 or time.monotonic() >= deadline:
                raise
            retries += 1
            level = logging.INFO if retries == 1 else logging.DEBUG  # one line per message, not per attempt
            log.log(level, "publishing to %s: %s; retrying for up to %g s", subject, type(exc).__name__, deadline_s)
            if not isinstance(exc, nats.errors.TimeoutError):
                await asyncio.sleep(PUBLISH_RETRY_S)


OWN_QUEUE_INACTIVE_S = 3600.0  # a worker's own consumer outlives its worker by this long (JetStream deletes it)


async def job_consumer(
    js: JetStreamContext,
    subject: str,
    ack_wait_s: float = 30.0,
    max_deliver: int = 5,
    inactive_threshold_s: float | None = None,
) -> JetStreamContext.PullSubscription:
    """The durable pull consumer for `subject`: the shared one of a role and model, or a worker's own (its routed
    prefill jobs: `inactive_threshold_s` lets JetStream delete it once its worker is gone)."""
    durable = subject.replace(".", "-")
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        filter_subject=subject,
        inactive_threshold=inactive_threshold_s,
    )
    return await js.pull_subscribe(subject, durable=durable, stream=JOBS_STREAM, config=config)
