"""The worker runtime every role shares: connect, the capacity-gated job loop, the one cancel path and the one
failure path, draining and heartbeats (the job queue's consumer: job_feed.py; token events out: outbox.py). The
roles (services/prefill, decode, mixed) add what they do with a job and with the engine's outputs.

A worker process may change role (host.py): a role's `leave` drains it for another (what it holds finishes, or is
handed on), and the next role is built over the same engine, group and connections (`succeeds`).

A request's life in a worker is one ledger entry (ledger.py); what the loop knows of the engine is the load
snapshot the engine thread publishes (engine_load.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic

import msgspec
import nats.errors
from nats.aio.msg import Msg

from shared import bus
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, RequestOutput
from shared.expert_affinity import HotExpertsWindow
from shared.job_checks import Refusal, job_refusal, undecodable_job_refusal
from shared.messages import (
    Cancel,
    DecodeJob,
    Heartbeat,
    Job,
    PrefillJob,
    Role,
    TokenEvent,
    decode,
    decode_or_drop,
    heartbeat_subject,
)
from shared.redis_client import redis_client
from shared.settings import WorkerSettings
from shared.telemetry import metrics
from shared.worker import gauges, spans
from shared.worker.block_announcer import BlockAnnouncer, announces_blocks
from shared.worker.calibration import PullCalibration, StepCalibration, path_calibration
from shared.worker.cancel_feed import CancelFeed
from shared.worker.cancels import CancelMemory
from shared.worker.choices import choice_jobs
from shared.worker.connections import Connections
from shared.worker.engine_factory import build_engine
from shared.worker.engine_load import EngineLoad
from shared.worker.events import announce_event, error_event
from shared.worker.expert_recorder import ExpertTraceRecorder
from shared.worker.heartbeat import HEARTBEAT_S, beat_facts, build_heartbeat, publish_heartbeats
from shared.worker.job_feed import JobFeed
from shared.worker.ledger import Entry, JobLedger, Phase, settle
from shared.worker.outbox import Outbox
from shared.worker.probes import WorkerProbes
from shared.worker.resend import Resender, SentEvents

if TYPE_CHECKING:
    from shared.parallel.group_engine import WorkerGroup

log = logging.getLogger(__name__)
TEARDOWN_TIMEOUT_S = 30.0
IDLE_POLL_S = 0.005  # how often a worker without room looks again
# A KV location read or written waits at most this long: a primary gone without a word (its host lost) is a miss,
# and the request is recomputed, not held up for TCP's own timeout of minutes.
REDIS_TIMEOUT_S = 5.0
# A draining worker's own queue is handed back at least this long: until the gateways have its `draining` beat,
# they may still route jobs to it
HAND_BACK_S = 2 * HEARTBEAT_S


@dataclass(frozen=True)
class Leaving:
    """How a role's leave (Worker.leave) went: idle in time (the role is done), how many requests in hand finished
    here (or were handed on to decode as usual) and how many were handed on to the prefill queue, how long."""

    idle: bool
    finished: int
    handed_on: int
    took_s: float


class Worker(Generic[Job]):
    """Base of the three roles, generic over the job kind a role takes. Subclasses set `role`, `job_subject()`
    and implement `handle_job` and `handle_outputs`; `run()` connects (`conn`) and serves until `stop()`: the
    first call drains (no new jobs; what is in flight finishes, for at most drain_timeout_s), a second one stops
    at once.

    Jobs: `take(msg, kind, phase)` decodes a job and registers it in the ledger (or says there is nothing to
    do); until acked its message is reported in progress every third of ack_wait, so JetStream redelivers it
    only when this worker is dead or hung. A taken job is announced to the gateway at once (an event with no
    tokens): from then on this worker holds the request."""

    role: ClassVar[Role] = Role.MIXED

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine | None = None,
        group: WorkerGroup | None = None,
        succeeds: Worker | None = None,
    ) -> None:
        """engine: instead of building one from the settings (tests); group: the worker group it leads, if any.
        succeeds: the role this one takes over from in the same process (a role switch, host.py): its engine and
        group, connections, metrics server, cancels, cost coefficients and expert trace carry over."""
        self.settings = settings
        self.model_name = settings.served_model_name
        self.labels = (self.model_name, self.role)  # every metric's model_name, role
        self.metrics_port: int | None = None  # bound once run() starts the metrics server
        if succeeds is not None:
            engine, group = succeeds.engine.engine, succeeds.group
        elif engine is None:
            engine, group = build_engine(settings)
        self.group = group  # a worker group's leader: its layout and ranks go in every heartbeat
        self._group_facts = {} if group is None else {"parallel": str(group.layout), "rank_pids": tuple(group.pids)}
        self.load = EngineLoad.of(engine)  # replaced by the engine thread after every command and step
        # the live cost coefficients every heartbeat carries (calibration.py): steps fitted on the engine thread,
        # KV pulls (decode workers) on the loop
        self.step_costs = StepCalibration()
        self.pull_costs = PullCalibration()
        self._kv_bytes_per_token = engine.layout.bytes_per_token
        # --record-expert-trace: every step's expert load to a file (looked at in _observe); None = off, no cost. A
        # role switch ends the old role's segment of the file and starts one of this role's (its header names it)
        if succeeds is not None and succeeds.expert_trace is not None:
            succeeds.expert_trace.close()
        self.expert_trace = (
            ExpertTraceRecorder(settings.record_expert_trace, engine, self.role, self.model_name, settings.worker_id)
            if settings.record_expert_trace
            else None
        )
        self.engine = AsyncEngine(engine, self._outputs_ready, self._engine_failed, on_state=self._observe)
        self.failure: BaseException | None = None  # why the engine thread died; the worker then exits non-zero
        self.stopping = asyncio.Event()
        self.taking_jobs = asyncio.Event()  # set once serve() takes jobs (its loops started): a switch is done
        self._conn: Connections | None = None  # set by connect(): read through `conn`
        self.rpc_address: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.outbox = Outbox()  # token events leave in order, through one publisher
        self.draining = False  # takes no new job: stopping (stop()) or leaving for another role (leave())
        self.stop_asked = False  # stop() was called once: the drain ends the process (a second call stops now)
        self.switching_to: Role | None = None  # leave(): the role that follows this one, in every heartbeat
        self._fetching = False  # a job fetch is in flight (its job may still come: not idle)
        self.serving = False  # connected, engine started, tasks running: /ready (probes.py) until it stops
        self.last_beat: float | None = None  # when the heartbeat task last built a beat: /health (probes.py)
        self.cancels = CancelMemory()
        self._cancels_from: int | None = None  # the cancel stream's sequence to read from (a successor's start)
        # every token event sent, kept while the request is in hand and a while after: sent again when a gateway
        # lacks some or NATS reconnects (resend.py). The process's: a successor role resends what this one sent.
        self.sent = SentEvents(self._holds_attempt)
        self.resender = Resender(self.sent, self.model_name, self.outbox.emit, self.labels)
        self._integrity: str | None = None  # the engine's last integrity verdict (refreshed off the beat)
        # a decode (or mixed) worker's recent hot experts, in its heartbeat for expert-affinity routing (MoE models)
        self.hot_experts = HotExpertsWindow()
        self.blocks_announcer: BlockAnnouncer | None = None  # prefix-cache blocks out to the gateways, if any
        self._own_feed: JobFeed | None = None  # the queue of jobs routed to this worker alone, once bound
        self._handing_back: asyncio.Task | None = None  # draining or leaving: the own queue's jobs to the shared one
        self._probes: WorkerProbes | None = None  # what the metrics server's /health and /ready ask (connect)
        if succeeds is not None:
            self._take_over(succeeds)
        self.ledger: JobLedger[Job] = JobLedger(self.cancels)  # the cancels remembered (a predecessor's too)

    def _holds_attempt(self, key: str) -> bool:
        return self.ledger.get(key) is not None

    def _take_over(self, old: Worker) -> None:
        """What carries over from the role this one succeeds: the process's, not the role's."""
        self._conn, self.metrics_port = old._conn, old.metrics_port
        self._probes = old._probes
        if self._probes is not None:  # the metrics server's /health and /ready read this role from now on
            self._probes.worker = self
        self.cancels, self._cancels_from = old.cancels, old._cancels_from
        self.sent, self.resender = old.sent, old.resender
        self.sent.in_hand = self._holds_attempt  # in hand: in this role's ledger (what the old one held was handed on)
        self.resender.emit_with(self.outbox.emit)  # resent events leave through this role's publisher
        self.step_costs, self.pull_costs = old.step_costs, old.pull_costs

    @property
    def conn(self) -> Connections:
        """NATS, JetStream and Redis; a RuntimeError before run() has connected them."""
        if self._conn is None:
            raise RuntimeError(f"the {self.role} worker is not connected: run() connects it")
        return self._conn

    # ---- to implement -----------------------------------------------------------------------------------

    def job_subject(self) -> str:
        raise NotImplementedError

    def own_job_subject(self) -> str | None:
        """The queue of jobs routed to this worker alone (prefill and mixed: KV-aware routing; decode: decode-side
        reuse); None: no such."""
        return None

    async def handle_job(self, msg: Msg) -> None:
        """Take one job message; ack it when the job is safely handed on."""
        raise NotImplementedError

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def held_kv_count(self) -> int:
        """Requests whose KV this worker holds for someone else's pull (prefill workers)."""
        return 0

    async def setup(self) -> None:
        """Role-specific start-up after the connections exist (e.g. the KV transfer server)."""

    async def teardown(self) -> None:
        """Role-specific shutdown."""

    # ---- capacity ---------------------------------------------------------------------------------------

    def _observe(self, engine: Engine) -> None:
        """On the engine thread: publish a fresh snapshot (one reference assignment: atomic for the loop), and the
        step coefficients refitted after a step."""
        self.step_costs.observe(engine.stats)
        self.load = EngineLoad.of(engine)
        if self.expert_trace is not None:
            self.expert_trace.observe(engine)

    def nats_connected(self) -> bool:
        return self._conn is not None and self._conn.nc.is_connected

    def has_room(self) -> bool:
        """Fetch a job only when the engine can start it soon (EngineLoad.has_room, on the latest snapshot)."""
        return self.load.has_room()

    def idle(self) -> bool:
        """Nothing in hand: no job in the ledger, no request in the engine (running, waiting or holding KV), no
        token event waiting to leave, no job fetch whose job may still come."""
        return not self.ledger and not self.load.requests and self.outbox.empty() and not self._fetching

    # ---- life -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve until stop(), close: a process of this one role (host.py runs roles in turn)."""
        if not await self.connect():
            return
        try:
            await self.serve()
        finally:
            await self.close()

    async def connect(self) -> bool:
        """NATS, JetStream and Redis, the streams, the metrics server; False when stopped before NATS answered."""
        connecting = asyncio.ensure_future(bus.connect(self.settings, f"{self.role}-{self.settings.worker_id}"))
        stopped = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((connecting, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not connecting.done():  # SIGTERM while NATS is unreachable (or refuses us): nothing to drain
            connecting.cancel()
            return False
        nc = connecting.result()
        redis = redis_client(self.settings, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
        self._conn = Connections(nc, nc.jetstream(), redis)
        await bus.ensure_streams(self.conn.js, self.settings.jetstream_replicas)
        if self.settings.metrics_port is not None:
            self._probes = WorkerProbes(self)  # /health, /ready beside /metrics: of the role serving (a successor's)
            routes = self._probes.routes()
            self.metrics_port = metrics.serve_metrics(self.settings.metrics_host, self.settings.metrics_port, routes)
            log.info("metrics at http://%s:%d/metrics", self.settings.metrics_host, self.metrics_port)
        return True

    async def serve(self) -> None:
        """Serve this role until `stopping`: the engine thread, the role's setup, its loops; then shut them down
        (the connections stay open: `close`). Raises what the role's setup raised."""
        self.engine.start()
        try:
            await self.setup()
            cancels = CancelFeed(self.conn.nc, self._cancel_received)
            await cancels.start(self._cancels_from)
            await self.resender.start(self.conn.nc)  # once a process: a successor role's call finds it listening
            announcing = await self._start_announcing_blocks()
            self._tasks += [  # a drain begun during the setup (a stop) is among them already
                *announcing,
                asyncio.create_task(self._read_cancels(cancels)),
                asyncio.create_task(self.resender.run(self.conn.nc)),
                asyncio.create_task(self._heartbeats()),
                asyncio.create_task(self._engine_facts()),
                asyncio.create_task(self._job_loop()),
                asyncio.create_task(self.outbox.publish_forever(self.conn.nc)),
            ]
            load = self.load
            log.info(
                "%s worker %s serving %s (KV cache: %d tokens, max_model_len %d)",
                self.role,
                self.settings.worker_id,
                self.model_name,
                load.total_blocks * load.block_size,
                load.max_model_len,
            )
            self.serving = True
            self.taking_jobs.set()
            await self.stopping.wait()
        finally:
            self.serving = False
            await self._shut_down()

    async def _read_cancels(self, cancels: CancelFeed) -> None:
        try:
            await cancels.run()
        finally:  # where a successor role reads on from
            self._cancels_from = cancels.next_seq

    async def close(self) -> None:
        """The process's end: the expert trace's last steps to its file, the connections closed."""
        began = time.monotonic()
        if self.expert_trace is not None:  # the engine thread is gone: its last steps go to the file now
            self.expert_trace.close()
        await self.conn.close()
        # the last line of a worker's log: where its exit went, when a supervisor's bound is tight
        log.info("%s worker %s closed its connections in %.2f s", self.role, self.settings.worker_id,
                 time.monotonic() - began)  # fmt: skip

    async def _shut_down(self) -> None:
        began = time.monotonic()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        tasks_done = time.monotonic()
        try:  # bounded: a teardown must not keep a failed worker from exiting
            await asyncio.wait_for(self.teardown(), TEARDOWN_TIMEOUT_S)
        except Exception as exc:
            log.warning("teardown did not finish cleanly: %r", exc)
        torn_down = time.monotonic()
        await self.engine.stop()
        engine_stopped = time.monotonic()
        log.info(
            "%s worker %s stopped in %.2f s (tasks %.2f, teardown %.2f, engine %.2f)",
            self.role,
            self.settings.worker_id,
            engine_stopped - began,
            tasks_done - began,
            torn_down - tasks_done,
            engine_stopped - torn_down,
        )

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine thread died: stop at once (exit non-zero, heartbeats end), so that the gateway moves this
        worker's requests elsewhere instead of waiting on an engine that will never step again."""
        log.critical("the engine failed (%r); this worker stops so that its requests move to others", exc)
        self.failure = exc
        self.stopping.set()

    def stop(self) -> None:
        """SIGTERM / SIGINT: the first call drains, a second stops now. While leaving for another role (leave),
        the first call lets the leave go on, and the process ends when it does."""
        if self.stop_asked or self._conn is None:
            self.stopping.set()
            return
        self.stop_asked = True
        if self.draining:  # leaving already: leave() ends in a stop
            return
        self.draining = True
        self._tasks.append(asyncio.create_task(self._drain()))

    async def _drain(self) -> None:
        timeout = self.settings.drain_timeout_s
        log.info("draining: taking no new jobs, finishing what is in flight (at most %g s)", timeout)
        started = time.monotonic()
        deadline = started + timeout
        hand_back_until = self._hand_back_own_queue(started, deadline)
        idle = await self._until_idle(deadline, hand_back_until)
        if not idle:
            log.warning("drain timed out after %g s with work in hand; stopping anyway", timeout)
        await self._flush_and_stop(started)

    def _hand_back_own_queue(self, started: float, deadline: float) -> float:
        """Jobs routed to this worker's own queue and not taken go to the shared queue from now on (a task); →
        until when a drain waits at least (HAND_BACK_S: the gateways route here until they have this beat)."""
        if self._own_feed is None:
            return started
        self._handing_back = asyncio.create_task(self._own_feed.hand_back(self.job_subject()))
        self._tasks.append(self._handing_back)
        return min(started + HAND_BACK_S, deadline)

    async def _until_idle(self, deadline: float, not_before: float = 0.0, then=None) -> bool:
        """Wait until idle (and at least until `not_before`), at most until `deadline`; → whether idle. `then`: a
        coroutine function run between looks (handing requests on)."""
        while (not self.idle() or time.monotonic() < not_before) and time.monotonic() < deadline:
            if then is not None:
                await then()
            await asyncio.sleep(0.05)
        return self.idle()

    async def _flush_and_stop(self, started: float) -> None:
        flushing = time.monotonic()
        with contextlib.suppress(Exception):  # the last token events out before the connection closes
            await asyncio.wait_for(self.conn.nc.flush(), 2.0)
        now = time.monotonic()
        log.info("drained in %.2f s (the last flush %.2f s)", now - started, now - flushing)
        self.stopping.set()

    async def leave(self, to: Role, finish_s: float, timeout_s: float) -> Leaving:
        """Switch away from this role (host.py): take no new job (this role's own queue handed back to the shared
        one), let what is in hand finish for `finish_s` — then hand on what still runs (`hand_on_in_hand`: decode
        and mixed requests go to the prefill queue with their tokens so far) — and wait, at most `timeout_s` in all,
        for the rest (KV held for a pull is pulled or expires; pulls in flight end). Idle: `stopping` is set
        (serve() returns) and the result says so. Not idle in time: this role takes jobs again — unless stop() was
        called meanwhile: then it drains and stops as a stop does."""
        started = time.monotonic()
        self.draining, self.switching_to = True, to
        in_hand = len(self.ledger) + self.held_kv_count()
        deadline = started + timeout_s
        hand_back_until = self._hand_back_own_queue(started, deadline)
        handed_on = 0

        async def hand_on() -> None:
            nonlocal handed_on
            handed_on += await self.hand_on_in_hand()

        await self._until_idle(min(started + finish_s, deadline))  # what it holds may finish here
        # then what still runs is handed on, and the own queue handed back for HAND_BACK_S at least
        idle = await self._until_idle(deadline, hand_back_until, then=hand_on)
        leaving = Leaving(idle, max(0, in_hand - handed_on), handed_on, time.monotonic() - started)
        if not idle and not self.stop_asked:
            self._own_feed_back_in_service()
            self.draining, self.switching_to = False, None
            return leaving
        if not idle:
            await self._until_idle(started + self.settings.drain_timeout_s)
        await self._flush_and_stop(started)
        return leaving

    def _own_feed_back_in_service(self) -> None:
        """A leave called off: the own queue's hand-back ends (the job loop fetches from it again)."""
        if self._handing_back is not None:
            self._handing_back.cancel()
            self._tasks.remove(self._handing_back)
            self._handing_back = None

    async def hand_on_in_hand(self) -> int:
        """Leaving this role: hand on what it would otherwise finish itself, now; → how many requests. Decode and
        mixed workers hand their running requests to the prefill queue (StreamingWorker); a prefill worker's jobs
        end at their first token, and its held KV waits for its pull: nothing to do."""
        return 0

    # ---- jobs -------------------------------------------------------------------------------------------

    async def take(self, msg: Msg, kind: type[Job], phase: Phase) -> Entry[Job] | None:
        """Decode a job message (raises on a malformed one) and register it in the ledger in `phase` with its
        process span open, announced to the gateway; None when there is nothing to do (refused, cancelled, or a
        copy of one in hand: JobLedger.take)."""
        try:
            job = decode(msg.data, kind)
        except msgspec.ValidationError:  # out of the wire's ranges: refused when it says where to answer
            if self.refused_undecodable(msg, kind):
                return None
            raise  # malformed: the job loop drops it
        if self.refused(msg, job):
            return None
        worker_id = self.settings.worker_id
        open_span = functools.partial(spans.process_span, msg, job.request_id, worker_id)
        entry = await self.ledger.take(msg, job, phase, open_span, in_engine=job.key in self.load.requests)
        if entry is not None:
            self.emit(job.reply_subject, announce_event(job, worker_id))
        return entry

    async def take_choices(self, msg: Msg, kind: type[Job], phase: Phase) -> list[Entry[Job]]:
        """`take`, then the job's choices split: the one place a worker splits a job of n choices (choices.py).
        → the job's own entry (its job now its own choice alone) and the other choices' entries (`adopt`), in
        choice order; empty when there is nothing to do."""
        entry = await self.take(msg, kind, phase)
        if entry is None:
            return []
        own, *others = choice_jobs(entry.job)
        entry.job = own
        return [entry, *self.adopt(entry, others, phase)]

    def adopt(self, group: Entry[Job], jobs: list[Job], phase: Phase) -> list[Entry[Job]]:
        """The entries of a group job's other choices (worker/choices.py), registered in `phase` and announced to
        the gateway; a choice already cancelled is left out."""
        entries = [e for j in jobs if (e := self.ledger.adopt(j, phase, group.span, group.key)) is not None]
        for e in entries:
            self.emit(e.reply_subject, announce_event(e.job, self.settings.worker_id))
        return entries

    def refused(self, msg: Msg, job: PrefillJob | DecodeJob) -> bool:
        """True for a job the engine must not see (shared/job_checks.py: it would fail on the engine thread)."""
        refusal = job_refusal(job, self.load.vocab_size, self.load.max_model_len)
        if refusal is not None:
            self._refuse(msg, job, refusal)
        return refusal is not None

    def refused_undecodable(self, msg: Msg, kind: type[Job]) -> bool:
        """True for a job that failed validation (e.g. a temperature of -1) but names a request and a token
        subject: refused as a decoded one would be."""
        answer = undecodable_job_refusal(msg.data, kind)
        if answer is not None:
            self._refuse(msg, *answer)
        return answer is not None

    def _refuse(self, msg: Msg, job: PrefillJob | DecodeJob, refusal: Refusal) -> None:
        """Terminate a refused job's message, with a warning naming why and an error event back where its reply
        subject allows."""
        log.warning("refusing job %.80r on %s: %s", job.request_id, msg.subject, refusal.reason)
        if refusal.reply:  # every choice of a group job: each waits for its own answer
            for one in choice_jobs(job) if isinstance(job, PrefillJob) else choice_jobs(job):
                self.emit(one.reply_subject, error_event(one, refusal.reason, self.settings.worker_id))
        asyncio.create_task(settle(msg.term()))

    def is_cancelled(self, request_id: str, attempt: int) -> bool:
        return self.cancels.is_cancelled(request_id, attempt)

    async def fail(self, entry: Entry[Job], exc: Exception) -> None:
        """The one failure path: answer the job with an error event — 400 for a ValueError (the engine refused
        it), 500 for anything else (a bug: logged with its traceback) —, abort it in the engine when it got that
        far (phase RUNNING: in any other phase the failure was the engine refusing it), terminate its message
        (never redelivered) and end its spans as failed."""
        status = 400 if isinstance(exc, ValueError) else 500
        if status == 500:
            log.error("handling %s failed", entry.key, exc_info=exc)
        in_hand = self.ledger.get(entry.key) is entry
        if in_hand and entry.phase is Phase.RUNNING:
            await self.engine.call(lambda e: e.abort(entry.key))
        self.emit(entry.reply_subject, error_event(entry.job, str(exc), self.settings.worker_id, status=status))
        if in_hand:
            await self.ledger.term(entry.key)
        spans.end_once(entry.decode_span, error=str(exc))
        spans.end_once(entry.span, error=str(exc))

    async def on_cancel(self, cancel: Cancel) -> None:
        """The one cancel path: remember it (a job of a covered attempt may still arrive), then drop every entry
        it covers."""
        self.cancels.remember(cancel)
        self.sent.forget(cancel)
        for entry in self.ledger.covered_by(cancel):
            await self.drop(entry)

    async def drop(self, entry: Entry[Job]) -> None:
        """Stop one cancelled request. In the engine: forgotten (its message acked: the client is gone or the
        request moved on, so the job is done), aborted (blocks freed), its spans ended as cancelled. Owned by a
        task (a KV pull, a hand-on): marked, and that task drops it at its next step."""
        if not entry.phase.in_engine:
            entry.cancelled = True
            return
        self.ledger.finish(entry.key)
        await self.engine.call(lambda e: e.abort(entry.key))
        spans.end_once(entry.decode_span, error="cancelled", finish_reason="abort")
        spans.end_once(entry.span, error="cancelled")

    async def _cancel_received(self, msg: Msg) -> None:
        cancel = decode_or_drop(msg.data, Cancel, msg.subject)
        if cancel is not None:
            await self.on_cancel(cancel)

    async def _job_loop(self) -> None:
        ack_wait = self.settings.job_ack_wait_s
        feeds = [JobFeed(self.conn.js, self.job_subject(), ack_wait)]
        if (own := self.own_job_subject()) is not None:
            self._own_feed = JobFeed(self.conn.js, own, ack_wait, inactive_threshold_s=bus.OWN_QUEUE_INACTIVE_S)
            feeds.insert(0, self._own_feed)
        consumers = [await feed.bind() for feed in feeds]
        shortest = min(feeds, key=lambda f: f.ack_wait_s)  # progress reports cover every job in hand
        self._tasks.append(asyncio.create_task(shortest.report_progress(self.ledger.in_progress)))
        await self.fetch_jobs(*consumers)

    async def fetch_jobs(self, *consumers) -> None:
        """Until stopping: whenever there is room (and not draining), fetch one job from each consumer at once —
        its own queue's first, the shared one's — and handle what comes, its own first. A fetch started with room
        may bring its job after the room is gone: at most one job per consumer beyond it."""
        fetching: dict[int, asyncio.Task] = {}  # consumer's index → its fetch in flight
        try:
            while not self.stopping.is_set():
                room = not self.draining and self.has_room()
                if room:
                    for i, consumer in enumerate(consumers):
                        if i not in fetching:
                            fetching[i] = asyncio.ensure_future(consumer.fetch(batch=1, timeout=1.0))
                self._fetching = bool(fetching)
                if not fetching:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                await asyncio.wait(
                    fetching.values(), timeout=None if room else IDLE_POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                for i in sorted(i for i, task in fetching.items() if task.done()):
                    await self._handle_fetched(fetching.pop(i))
                self._fetching = bool(fetching)
        finally:
            self._fetching = False
            for task in fetching.values():
                task.cancel()

    async def _handle_fetched(self, fetch: asyncio.Task) -> None:
        try:
            msgs = fetch.result()
        except (TimeoutError, nats.errors.TimeoutError):
            return
        except Exception as exc:  # NATS restarting: wait and retry, never die
            log.warning("fetching jobs failed (%s); retrying", exc)
            await asyncio.sleep(0.5)
            return
        for msg in msgs:
            if self.switching_to is not None:  # leaving this role (a fetch sent before): another worker of it takes it
                log.info("leaving the %s role: a job fetched meanwhile goes back to its queue", self.role)
                await settle(msg.nak())
                continue
            try:
                await self.handle_job(msg)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("dropping malformed job on %s: %s", msg.subject, exc)
                await settle(msg.term())
            except Exception:  # a bug on one job must not end the loop that takes every later one
                log.exception("handling a job on %s failed; dropping it", msg.subject)
                self.ledger.forget_message(msg)
                await settle(msg.term())

    # ---- token events -----------------------------------------------------------------------------------

    def _outputs_ready(self, outputs: list[RequestOutput]) -> None:
        try:
            self.handle_outputs(outputs)
        except Exception:
            log.exception("handling engine outputs failed")

    def emit(self, subject: str, event: TokenEvent) -> None:
        """Queue a token event for publishing (callable from the loop without awaiting), kept to send again."""
        self.sent.record(subject, event)
        self.outbox.emit(subject, event)

    # ---- heartbeats and block announcements --------------------------------------------------------------

    async def _start_announcing_blocks(self) -> list[asyncio.Task]:
        """A worker with its own queue (prefill, mixed, decode) tells the gateways which prefix-cache blocks it
        holds, when its engine has a prefix cache (block_announcer.py); its task, or none."""
        engine = self.engine.engine
        if self.own_job_subject() is None or not announces_blocks(engine):
            return []
        announcer = BlockAnnouncer(
            self.conn.nc, self.engine.call, self.model_name, self.settings.worker_id, self.load.block_size
        )
        await announcer.start()
        self.blocks_announcer = announcer
        return [asyncio.create_task(announcer.run())]

    async def _engine_facts(self) -> None:
        """Integrity and expert load from the engine thread, between its steps (a long step delays this,
        never the heartbeat: the gateway judges liveness by the beat)."""
        while True:
            self._integrity, expert_load, rank_load = await self.engine.call(beat_facts)
            gauges.record_expert_load(self.labels, expert_load)
            gauges.record_rank_load(self.labels, rank_load)
            if self.role is not Role.PREFILL and expert_load:
                self.hot_experts.add(expert_load)
            rebalancer = self.group.rebalancer if self.group is not None else None
            if rebalancer is not None:  # its counts change on the engine thread: read them there
                gauges.record_eplb(self.labels, await self.engine.call(lambda _, r=rebalancer: r.take_stats()))
            await asyncio.sleep(HEARTBEAT_S)

    def heartbeat(self) -> Heartbeat:
        """This worker's beat now (from the latest load snapshot); sets the load gauges on the way."""
        self.last_beat = time.monotonic()
        load = self.load
        gauges.record_load(self.labels, load)
        return build_heartbeat(
            load,
            worker_id=self.settings.worker_id,
            role=self.role,
            model=self.model_name,
            rpc_address=self.rpc_address,
            held_kv=self.held_kv_count(),
            integrity_error=self._integrity,
            draining=self.draining,
            switching_to=self.switching_to,
            path_calibration=path_calibration(self.step_costs.costs, self.pull_costs, self._kv_bytes_per_token),
            blocks=self.blocks_announcer,
            hot_experts=self.hot_experts.hot,
            **self._group_facts,
        )

    async def _heartbeats(self) -> None:
        await publish_heartbeats(self.conn.nc, heartbeat_subject(self.role, self.settings.worker_id), self.heartbeat)
