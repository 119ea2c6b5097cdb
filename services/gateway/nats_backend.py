"""The GatewayBackend over NATS: jobs out through JetStream, token events back on one wildcard subscription.

One listener (`pd.tokens.<gateway>.>`) serves every request: it decodes each TokenEvent and routes it
by request id to that request's RequestUpdates (request_stream.py: order, deadlines).
A request's stream is registered before its job is published, so no event can arrive unclaimed.
Heartbeats (`pd.hb.>`) feed the live-worker table behind readiness and the 503 on dispatch.
A fresh prompt's job goes where prefill routing says (kv_routing.py): the shared prefill queue, or with KV-aware
routing the own queue of the worker holding its prefix, which then holds the request until it takes it.

A watchdog moves requests whose worker died or stalled (request_stream.RequestUpdates.why_move): it cancels
the old attempt (`Cancel.up_to_attempt`) and dispatches the next one to the prefill queue, carrying every
token delivered so far: a prefill (or mixed) worker recomputes prompt + tokens, samples the next one and hands
on as usual. The client's stream goes on: positions already delivered are dropped.
While the gateway itself is cut off from NATS it judges nobody: heartbeats could not reach it.

Token events lost on the way (core NATS: a restart, a failover) are asked for again (resend_asks.py), not moved
for: a request moves only when its holder is gone (or a gap outlives the asking: nobody can send it again). A
cancel published while NATS is away is retried until JetStream has it (`PD_CANCELS` keeps it for the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.gateway.admission import Admission
from services.gateway.backend import BackendUnavailable, GenerationJob, Update, choice_requests
from services.gateway.decode_router import affinity
from services.gateway.kv_routing import count_route, prefill_routing, route_subject
from services.gateway.liveness import WorkerTable
from services.gateway.path_dispatch import PathChooser, dispatch
from services.gateway.path_signals import OwnLoad
from services.gateway.request_stream import Deadlines, RequestUpdates
from services.gateway.resend_asks import ResendAsks
from shared import bus
from shared.messages import (
    HEARTBEAT_WILDCARD,
    Cancel,
    Heartbeat,
    PrefillJob,
    RequestStat,
    Role,
    Sibling,
    cancel_subject,
    decode_event_or_drop,
    decode_or_drop,
    encode,
    prefill_subject,
    request_stats_subject,
    token_subject,
    token_wildcard,
)
from shared.redis_client import explain_redis_error, redis_client
from shared.role_control import SwitchResult, switch_role
from shared.settings import GatewaySettings, PrefillPath
from shared.telemetry import metrics, tracing

log = logging.getLogger(__name__)

REDIS_PING_TIMEOUT_S = 2.0
SETUP_RETRY_S = 1.0
DRAIN_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 0.25
CANCEL_RETRY_S = 0.5  # a cancel that could not be published is tried again this often ...
CANCEL_GIVE_UP_S = 120.0  # ... for this long (NATS away longer: the workers run the request to its end)


class NatsBackend:
    def __init__(self, settings: GatewaySettings, gap_timeout_s: float = 5.0) -> None:
        self.settings = settings
        self.deadlines = Deadlines(settings.first_token_timeout_s, settings.request_timeout_s, gap_timeout_s)
        bus.tls_context(settings)  # unreadable TLS files stop the gateway at start, not in the background task
        self.workers = WorkerTable(settings.worker_ttl_s)
        ttft_limit_s = settings.path.ttft_slo_ms / 1e3 * settings.admission_ttft_factor
        self.admission = Admission(
            settings.max_pending_requests,
            settings.kv_overcommit,
            ttft_limit_s=ttft_limit_s if settings.admission_ttft_refuse else None,
        )
        self.paths = PathChooser(settings.path)  # remote (prefill worker + hand-off) or local, per request
        self.routing = prefill_routing(settings)  # where fresh prompts go: the shared queue, or a worker's own
        self._streams: dict[str, RequestUpdates] = {}  # request id → its stream, while the gateway listens
        self._nc: NATS | None = None  # set once connected and subscribed
        self._js: JetStreamContext | None = None
        self._redis = redis_client(settings, socket_connect_timeout=1.0, socket_timeout=2.0)
        self._setup: asyncio.Task[None] | None = None
        self._setup_error: str | None = None  # why connecting failed for good (a bad URL, say)
        self._watchdog: asyncio.Task[None] | None = None
        # asks the workers for token events the streams lack; knows when the client last reconnected
        self.resend = ResendAsks(settings.served_model_name, self._streams.values)
        self._asking: asyncio.Task[None] | None = None
        self._cancelling: set[asyncio.Task[None]] = set()  # cancels being published (held: the loop keeps weak refs)
        self._stats_out: set[asyncio.Task[None]] = set()  # request statistics being handed to the client
        self.gateway_id = settings.gateway_id

    async def start(self) -> None:
        """Connect in the background: until then, readiness says why not and dispatch answers 503."""
        self._setup = asyncio.create_task(self._connect(), name="gateway-nats-connect")
        self._setup.add_done_callback(self._setup_done)

    def _setup_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._setup_error = f"{type(task.exception()).__name__}: {task.exception()}"
            log.error("gateway NATS setup failed: %s", self._setup_error)

    async def _connect(self) -> None:
        nc = await bus.connect(self.settings, f"gateway-{self.settings.gateway_id}")
        js = nc.jetstream()
        while True:
            try:
                await bus.ensure_streams(js, self.settings.jetstream_replicas)
                break
            except Exception as exc:  # JetStream not ready yet (server starting): keep trying
                log.warning("jobs stream setup failed (%s); retrying", exc)
                await asyncio.sleep(SETUP_RETRY_S)
        await nc.subscribe(token_wildcard(self.settings.gateway_id), cb=self._on_token)
        await nc.subscribe(HEARTBEAT_WILDCARD, cb=self._on_heartbeat)
        await self.routing.start(nc)
        self._nc, self._js = nc, js
        self._watchdog = asyncio.create_task(self._watch(), name="gateway-watchdog")
        self._asking = asyncio.create_task(self.resend.run(nc), name="gateway-resend-asks")
        log.info("gateway %s connected to NATS", self.settings.gateway_id)

    async def _watch(self) -> None:
        """Every WATCH_INTERVAL_S: move the requests whose holder died or stalled."""
        ttl = self.settings.worker_ttl_s
        judge_from = time.monotonic() + ttl  # heartbeats need a ttl to arrive after (re)connecting
        seen_reconnect = None
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            if self._connected() is None:
                judge_from = now + ttl
                continue
            reconnected_at = self.resend.reconnected_at
            if reconnected_at != seen_reconnect:  # however short the absence, the beats sent meanwhile were lost
                seen_reconnect, judge_from = reconnected_at, max(judge_from, (reconnected_at or now) + ttl)
            await self.routing.tick(self.workers.serving(self.settings.served_model_name, now), now)
            if now < judge_from:
                continue
            for stream in list(self._streams.values()):
                why = stream.why_move(self.workers.last_seen, ttl, self.settings.stall_timeout_s, reconnected_at)
                why = why or self._left_its_queue(stream)
                if why is not None:
                    try:
                        await self._move(stream, why)
                    except Exception:  # never let one request stop the watchdog
                        log.exception("moving request %s failed", stream.request_id)

    def _left_its_queue(self, stream: RequestUpdates) -> str | None:
        """A job waiting in a worker's own queue whose worker no longer takes that queue: it switched role
        (docs/architecture.md, "Role switching") after the job was routed there and after handing its queue back.
        Nothing would take the job: it moves."""
        worker = stream.queued_for
        beat = self.workers.beat(worker) if worker is not None else None
        if beat is None or beat.switching_to is not None:  # switching: it hands its own queue back meanwhile
            return None
        takes = (Role.DECODE,) if stream.queued_for_decode else (Role.PREFILL, Role.MIXED)
        if beat.role in takes:
            return None
        return f"worker {worker} is a {beat.role} worker now: the queue the request waits in has no taker"

    async def _move(self, stream: RequestUpdates, why: str) -> None:
        """Cancel the stream's attempt and dispatch the next one elsewhere, or fail it after max_migrations."""
        rid, first = stream.request_id, stream.job
        if stream.migrations >= self.settings.max_migrations or first is None:
            message = f"{why}; the request already moved {stream.migrations} times and was given up"
            log.warning("request %s: %s", rid, message)
            stream.give_up(message, 502)
            await self.cancel(rid)
            return
        old = stream.attempt
        attempt = stream.move_on()
        phase = "decode" if stream.delivered else "prefill"
        metrics.REQUEST_MIGRATIONS.labels(self.settings.served_model_name, "gateway", phase).inc()
        log.warning(
            "request %s: %s; moving it on as attempt %d (%d tokens so far)", rid, why, attempt, stream.delivered
        )
        # Back to the prefill queue, with the tokens so far: recomputing them is prefill work (a decode worker
        # doing it would stall its batch), and a prefill worker hands the KV on to decode as usual.
        job = msgspec.structs.replace(first, attempt=attempt, output_token_ids=list(stream.tokens))
        subject = prefill_subject(first.model)
        nc, js = self._nc, self._js
        # _move's one caller, the watchdog, starts once _connect has set both, and neither is unset after
        assert nc is not None and js is not None
        try:  # the stream is already on the new attempt: a failure here must end it, not leave it unwatched
            await bus.publish_durably(js, cancel_subject(rid), encode(Cancel(rid, up_to_attempt=old)))
            await bus.publish_durably(js, subject, encode(job), headers=stream.trace_headers or None)
        except Exception as exc:
            stream.give_up(f"{why}; moving the request failed ({type(exc).__name__}: {exc})", 503)
            await self.cancel(rid)

    async def _on_token(self, msg: Msg) -> None:
        event = decode_event_or_drop(msg.data, msg.subject)
        if event is None:
            return
        stream = self._streams.get(event.request_id)
        if stream is None:
            log.debug("dropping token event of %s: no longer listening", event.request_id)
            return
        waiting_first = not stream.first_token_seen
        stream.push(event)
        if waiting_first and stream.first_token_seen and stream.migrations == 0 and stream.prefill_path is not None:
            self.paths.plane.observe(stream.prefill_path, time.monotonic() - stream.opened_at)  # its path's calibration

    async def _on_heartbeat(self, msg: Msg) -> None:
        beat = decode_or_drop(msg.data, Heartbeat, msg.subject)
        if beat is None:
            return
        self.workers.record(beat, time.monotonic())
        self.routing.on_heartbeat(beat)

    def _connected(self) -> NATS | None:
        return self._nc if self._nc is not None and self._nc.is_connected else None

    async def open(self, job: GenerationJob) -> RequestUpdates:
        return (await self.open_group(dataclasses.replace(job, n=1)))[0]

    async def open_group(self, job: GenerationJob) -> list[RequestUpdates]:
        """One stream per choice (each a request of its own: its holder, order, deadlines and moves), all
        registered, then one job carrying the other choices as siblings: the prompt is computed once. The job goes
        down the prefill path chosen for it (path_dispatch.py): to the prefill queue, or to the decode queue to be
        prefilled there."""
        if self._connected() is None or self._js is None:
            raise BackendUnavailable("not connected to NATS")
        ok, reason = self.workers.can_serve(job.model, time.monotonic())
        if not ok:
            raise BackendUnavailable(reason)
        self.admission.admit(self.workers, self._streams, job)  # raises Overloaded (429) past the bounds
        singles = choice_requests(job)
        if any(s.request_id in self._streams for s in singles):
            raise ValueError(f"request id {job.request_id!r} is already in flight")
        created_at = time.time()
        prefills = [
            PrefillJob(
                request_id=s.request_id,
                model=s.model,
                prompt_token_ids=s.prompt_token_ids,
                sampling=s.sampling,
                reply_subject=token_subject(self.settings.gateway_id, s.request_id),
                created_at=created_at,
                cache_salt=s.cache_salt,
                decode_kv_reuse=self.settings.decode_kv_reuse,
            )
            for s in singles
        ]
        siblings = [Sibling(p.request_id, p.reply_subject, p.sampling.seed) for p in prefills[1:]]
        group = msgspec.structs.replace(prefills[0], siblings=siblings)
        # the prefill worker it would go to (the shared queue, or one whose cache helps), whose expected hit the
        # path's cost model counts; then the path (neither reads this request's streams: they are not open yet)
        serving = self.workers.serving(job.model, time.monotonic())
        route = self.routing.route(job, serving, self._routed_backlog())
        hit = {route.worker_id: route.hit_tokens} if route.worker_id is not None else {}
        now = time.monotonic()
        choice = self.paths.choose(
            self.workers,
            job.model,
            len(job.prompt_token_ids),
            now,
            hit,
            self._own_load(job.model, now, PrefillPath.REMOTE),
            self._own_load(job.model, now, PrefillPath.LOCAL),
            remember=False,
        )
        self.admission.admit_path(choice, job)  # raises Overloaded (429) where the backlog misses the TTFT SLO
        self.paths.remember(choice, job.model, now, len(job.prompt_token_ids))
        # each stream keeps its choice's own job: a choice moves on alone, as the single request it equals
        streams = [RequestUpdates(p.request_id, self.deadlines, self.cancel, self.forget, job=p) for p in prefills]
        for stream in streams:
            self._streams[stream.request_id] = stream  # subscribe before dispatch
        subject, message = dispatch(choice, group)
        if choice.path is PrefillPath.REMOTE:
            count_route(job.model, route)
            subject = route_subject(job.model, route)
            if route.worker_id is not None:  # before the publish: the worker may take it before the ack is back
                for stream in streams:
                    stream.routed(route.worker_id)
            # and the decode worker its decode job goes to: the one whose cache holds most of the prompt, or any
            assert isinstance(message, PrefillJob)
            decode_worker = self.routing.route_decode(job, serving)
            by_affinity = None  # KV reuse first: affinity only decides where no decode worker holds any of the prompt
            if decode_worker is None and self.settings.expert_affinity_routing:
                decode_beats = [b for b in serving if b.role is Role.DECODE]
                by_affinity = affinity(len(job.prompt_token_ids), decode_beats, self.settings.expert_affinity_top_k)
            message = msgspec.structs.replace(message, decode_worker=decode_worker, decode_affinity=by_affinity)
        token = tracing.attach(tracing.extract(job.trace_context))  # the publish span joins the request's trace
        try:
            with tracing.producer_span(subject, job.request_id):
                headers = tracing.carrier() or None
                for stream in streams:
                    stream.trace_headers = headers or {}  # a moved request's jobs continue the same trace
                    stream.prefill_path = choice
                await bus.publish_durably(self._js, subject, encode(message), headers=headers)
        except Exception as exc:
            for stream in streams:
                self._streams.pop(stream.request_id, None)
                await self.cancel(stream.request_id)  # the job may be stored even though its ack was lost
            raise BackendUnavailable(f"could not dispatch the request ({type(exc).__name__}: {exc})") from exc
        finally:
            tracing.detach(token)
        return streams

    def _own_load(self, model: str, now: float, path: PrefillPath) -> OwnLoad:
        """Prompt tokens of this gateway's requests sent down `path` that no first token has answered yet, by the
        worker computing them: remote, the prefill workers; local, the decode workers. Those waiting in the job
        queues (routed to a worker's own queue, or an even share of the shared queue's), which no heartbeat counts:
        under load the backlog is in JetStream (docs/architecture.md, "The prefill path"); and those a worker has
        taken, which its heartbeat counts only from its next beat. Other gateways' queued requests are not seen; a
        request of n choices counts n times (one prefill computes them)."""
        remote = path is PrefillPath.REMOTE
        queued = self._routed_backlog() if remote else {}
        taken: dict[str, int] = {}
        shared = 0
        for s in self._streams.values():
            if s.delivered or s.finished or s.prefill_path is None or s.prefill_path.path is not path:
                continue
            if s.holder is None:
                shared += s.prompt_tokens
            elif s.queued_for is None:
                taken[s.holder] = taken.get(s.holder, 0) + s.prompt_tokens
        role = Role.PREFILL if remote else Role.DECODE
        takers = [b.worker_id for b in self.workers.serving(model, now) if b.role is role]
        for worker_id in takers:
            queued[worker_id] = queued.get(worker_id, 0) + shared // len(takers)
        return OwnLoad(queued, taken)

    def _routed_backlog(self) -> dict[str, int]:
        """Prompt tokens this gateway routed to each worker's own queue that the worker has not taken yet (its
        heartbeat cannot count them)."""
        backlog: dict[str, int] = {}
        for stream in self._streams.values():
            if stream.queued_for is not None:
                backlog[stream.queued_for] = backlog.get(stream.queued_for, 0) + stream.prompt_tokens
        return backlog

    async def cancel(self, request_id: str) -> None:
        """Publish the cancel in the background: its JetStream ack may take up to bus.PUBLISH_DEADLINE_S (a cluster
        electing the stream's leader), or never come while the connection drains at shutdown, and the client's stream
        must not wait for it to end. While NATS is away it waits for it to come back (CANCEL_GIVE_UP_S at most)."""
        if self._js is None:  # never connected: no worker can have the request
            return
        task = asyncio.get_running_loop().create_task(self._publish_cancel(self._js, request_id))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _publish_cancel(self, js: JetStreamContext, request_id: str) -> None:
        give_up_at = time.monotonic() + CANCEL_GIVE_UP_S
        while True:
            try:  # into the cancels stream: a worker disconnected now reads it when it is back (shared/bus.py)
                if self._connected() is not None:
                    cancel = encode(Cancel(request_id))
                    left = max(1.0, give_up_at - time.monotonic())  # through a stream leader's election too
                    await bus.publish_durably(js, cancel_subject(request_id), cancel, deadline_s=left)
                    return
                problem = "not connected to NATS"
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= give_up_at or self._nc is None or self._nc.is_closed:
                log.warning("could not publish the cancel of %s: %s", request_id, problem)
                return
            await asyncio.sleep(CANCEL_RETRY_S)

    def record_stat(self, stat: RequestStat) -> None:
        """Publish one request statistic (core NATS, fire and forget: while NATS is away it is not sent)."""
        nc = self._connected()
        if nc is None:
            return
        subject = request_stats_subject(self.settings.served_model_name)
        task = asyncio.get_running_loop().create_task(nc.publish(subject, encode(stat)))
        self._stats_out.add(task)
        task.add_done_callback(self._stats_sent)

    def _stats_sent(self, task: asyncio.Task[None]) -> None:
        self._stats_out.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a request statistic was not sent: %s", task.exception())

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- the admin API's (admin.py) -----------------------------------------------------------------

    def live_workers(self) -> list[tuple[Heartbeat, float]]:
        """Every live worker's latest heartbeat, and how old it is (seconds)."""
        now = time.monotonic()
        return [(beat, now - (self.workers.last_seen(beat.worker_id) or now)) for beat in self.workers.live(now)]

    async def switch_role(self, worker_id: str, role: Role, finish_s: float | None) -> SwitchResult:
        """Switch one worker's role the safe way (shared/role_control.switch_role: the deployment's lock, the
        safety rule judged on this gateway's live workers, the signed order), under a span of its own."""
        nc, secret = self._connected(), self.settings.cluster_secret
        if nc is None:
            raise BackendUnavailable("not connected to NATS")
        if not secret:
            raise BackendUnavailable("the gateway has no cluster_secret to sign role-switch orders with")
        span = tracing.start_span(f"role_switch {self.settings.served_model_name}", attributes={
            tracing.WORKER_ID: worker_id, "pdserve.role.to": role.value})  # fmt: skip
        with tracing.use_span(span, end_on_exit=False):
            result = await switch_role(
                nc, self._redis, worker_id, role, secret, workers=lambda: self.workers.live(time.monotonic()),
                finish_s=finish_s, holder=f"gateway {self.settings.gateway_id}", headers=tracing.carrier(),
            )  # fmt: skip
        span.set_attribute("pdserve.role_switch.outcome", result.outcome.value)
        tracing.end_span(span, error=None if result.switched else result.detail or result.outcome.value)
        log.info("role switch of %s to %s: %s %s", worker_id, role, result.outcome, result.detail)
        return result

    async def readiness(self) -> tuple[bool, str]:
        if self._setup_error is not None:
            return False, f"NATS setup failed: {self._setup_error}"
        problem = bus.connection_problem(f"gateway-{self.settings.gateway_id}")  # refused credentials, say
        why = f": {problem}" if problem else ""
        if self._nc is None:
            return False, "not connected to NATS yet" + why
        if not self._nc.is_connected:
            return False, "NATS connection lost; reconnecting" + why
        try:
            await asyncio.wait_for(self._redis.ping(), REDIS_PING_TIMEOUT_S)
        except Exception as exc:
            return False, f"Redis does not answer ({explain_redis_error(exc)})"
        return self.workers.can_serve(self.settings.served_model_name, time.monotonic())

    async def close(self) -> None:
        for task in (self._setup, self._watchdog, self._asking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for stream in list(self._streams.values()):
            stream.put(Update([], "error", "the gateway is shutting down", status=503))
        self._streams.clear()
        if self._nc is not None:
            try:  # drain: deliver what is in flight (cancels above) before closing
                await asyncio.wait_for(self._nc.drain(), DRAIN_TIMEOUT_S)
            except Exception as exc:
                log.warning("NATS drain failed (%s); closing", exc)
                with contextlib.suppress(Exception):  # bounded: a dead server must not keep the gateway from exiting
                    await asyncio.wait_for(self._nc.close(), DRAIN_TIMEOUT_S)
        for task in list(self._cancelling):  # those still waiting for NATS to come back: it will not, for us
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), DRAIN_TIMEOUT_S)
