"""What every worker role shares: engine thread, NATS and Redis clients, the capacity-gated job loop,
cancellation, heartbeats and token publishing. The roles (services/prefill, decode, mixed) add what
they do with a job and with the engine's outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

import msgspec
import nats.errors
from nats.aio.msg import Msg
from opentelemetry.trace import Span
from redis.asyncio import Redis

from shared import bus
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, RequestOutput
from shared.engine.request import FinishReason as EngineFinishReason
from shared.engine.sampling import SamplingParams
from shared.job_checks import job_refusal, undecodable_job_refusal
from shared.messages import (
    CANCEL_WILDCARD,
    Cancel,
    DecodeJob,
    FinishReason,
    Heartbeat,
    PrefillJob,
    Role,
    Sampling,
    TokenEvent,
    decode,
    decode_or_drop,
    encode,
    heartbeat_subject,
)
from shared.redis_client import redis_client
from shared.settings import WorkerSettings
from shared.telemetry import metrics, tracing

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
# How long a cancel is remembered: a cancelled attempt's job may still arrive later (a redelivery after
# ack_wait, a decode job published by a worker that was hung when its request moved on).
CANCEL_MEMORY_S = 600.0
MAX_REMEMBERED_CANCELS = 100_000
TEARDOWN_TIMEOUT_S = 30.0


def _integrity_error(engine: Engine) -> str | None:
    try:
        engine.check_integrity()
    except AssertionError as exc:
        return str(exc) or "integrity check failed"
    return None


def _beat_facts(engine: Engine) -> tuple[str | None, dict[int, list[int]]]:
    """On the engine thread: the integrity verdict and the expert load routed since the last beat."""
    load = {layer: counts.tolist() for layer, counts in engine.model.take_expert_load().items()}
    return _integrity_error(engine), load


def sampling_params(s: Sampling, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def build_engine(settings: WorkerSettings) -> Engine:
    return Engine(settings.engine)


class Worker:
    """Base of the three roles. Subclasses set `role`, `job_subject()` and implement `handle_job` and
    `handle_outputs`; `run()` serves until `stop()`: the first call drains (no new jobs; what is in flight
    finishes, for at most drain_timeout_s), a second one stops at once.

    Jobs: `take(msg, kind)` decodes a job and says whether to work on it (not a cancelled attempt, not a
    redelivery of one in hand); until `ack(key)` its message is kept and reported in progress every third of
    ack_wait, so JetStream redelivers it only when this worker is dead or hung. A taken job is announced
    to the gateway at once (an event with no tokens): from then on this worker holds the request."""

    role = Role.MIXED

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.model_name = settings.served_model_name
        self.labels = (self.model_name, self.role)  # every metric's model_name, role
        self.metrics_port: int | None = None  # bound once run() starts the metrics server
        self.engine = AsyncEngine(engine or build_engine(settings), self._outputs_ready, self._engine_failed)
        self.failure: BaseException | None = None  # why the engine thread died; the worker then exits non-zero
        self.stopping = asyncio.Event()
        self.nc = None
        self.js = None
        self.redis: Redis | None = None
        self.rpc_address: str | None = None
        self._tasks: list[asyncio.Task] = []
        # Token events leave through one queue and one publisher task: per-request order is kept.
        self._outbox: asyncio.Queue[tuple[str, TokenEvent]] = asyncio.Queue()
        self.draining = False
        self.unacked: dict[str, Msg] = {}  # attempt key → its job's message, until acked or terminated
        self._cancelled: OrderedDict[str, tuple[int | None, float]] = OrderedDict()  # id → (up to attempt, when)
        self._integrity: str | None = None  # the engine's last integrity verdict (refreshed off the beat)
        self._ack_wait_s = settings.job_ack_wait_s  # the job consumer's, once bound (_learn_ack_wait)

    # ---- to implement -----------------------------------------------------------------------------------

    def job_subject(self) -> str:
        raise NotImplementedError

    async def handle_job(self, msg: Msg) -> None:
        """Take one job message; ack it when the job is safely handed on."""
        raise NotImplementedError

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    async def on_cancel(self, cancel: Cancel) -> None:
        """Drop the attempts `cancel` covers (their work and KV)."""

    def held_kv_count(self) -> int:
        """Requests whose KV this worker holds for someone else's pull (prefill workers)."""
        return 0

    async def setup(self) -> None:
        """Role-specific start-up after the connections exist (e.g. the KV transfer server)."""

    async def teardown(self) -> None:
        """Role-specific shutdown."""

    # ---- machinery --------------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Fetch a job only when the engine can start it soon: a sequence slot and blocks to spare, and the
        queue shorter than one step's token budget — so the next step can batch several prompts, while a
        job another worker could start now is not hoarded here."""
        e = self.engine.engine
        return (
            e.num_running + e.num_waiting < e.config.scheduler.max_num_seqs
            and e.num_waiting_tokens < e.config.scheduler.max_num_batched_tokens
            and e.blocks.usage < 0.9
        )

    async def run(self) -> None:
        connecting = asyncio.ensure_future(bus.connect(self.settings, f"{self.role}-{self.settings.worker_id}"))
        stopped = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((connecting, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not connecting.done():  # SIGTERM while NATS is unreachable (or refuses us): nothing to drain
            connecting.cancel()
            return
        self.nc = connecting.result()
        self.js = self.nc.jetstream()
        await bus.ensure_jobs_stream(self.js)
        self.redis = redis_client(self.settings)
        if self.settings.metrics_port is not None:
            self.metrics_port = metrics.serve_metrics(self.settings.metrics_host, self.settings.metrics_port)
            log.info("metrics at http://%s:%d/metrics", self.settings.metrics_host, self.metrics_port)
        self.engine.start()
        try:
            await self.setup()
            await self.nc.subscribe(CANCEL_WILDCARD, cb=self._cancel_received)
            self._tasks = [
                asyncio.create_task(self._heartbeats()),
                asyncio.create_task(self._engine_facts()),
                asyncio.create_task(self._job_loop()),
                asyncio.create_task(self._publisher()),
                asyncio.create_task(self._progress_reports()),
            ]
            log.info("%s worker %s serving %s", self.role, self.settings.worker_id, self.model_name)
            await self.stopping.wait()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:  # bounded: a teardown must not keep a failed worker from exiting
                await asyncio.wait_for(self.teardown(), TEARDOWN_TIMEOUT_S)
            except Exception as exc:
                log.warning("teardown did not finish cleanly: %r", exc)
            await self.engine.stop()
            with contextlib.suppress(Exception):  # close, not drain: draining can wait ~30 s on a dead peer
                await asyncio.wait_for(self.nc.flush(), 1.0)
            with contextlib.suppress(Exception):
                await self.nc.close()
            await self.redis.aclose()

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine thread died: stop at once (exit non-zero, heartbeats end), so that the gateway moves this
        worker's requests elsewhere instead of waiting on an engine that will never step again."""
        log.critical("the engine failed (%r); this worker stops so that its requests move to others", exc)
        self.failure = exc
        self.stopping.set()

    def stop(self) -> None:
        """SIGTERM / SIGINT: the first call drains, a second stops now."""
        if self.draining or self.nc is None:
            self.stopping.set()
            return
        self.draining = True
        self._tasks.append(asyncio.create_task(self._drain()))

    def idle(self) -> bool:
        """Nothing in hand: no job unacked, no request in the engine (running, waiting or holding KV), no
        token event waiting to leave."""
        return not self.unacked and not self.engine.engine.requests and self._outbox.empty()

    async def _drain(self) -> None:
        timeout = self.settings.drain_timeout_s
        log.info("draining: taking no new jobs, finishing what is in flight (at most %g s)", timeout)
        deadline = time.monotonic() + timeout
        while not self.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.idle():
            log.warning("drain timed out after %g s with work in hand; stopping anyway", timeout)
        with contextlib.suppress(Exception):  # the last token events out before the connection closes
            await asyncio.wait_for(self.nc.flush(), 2.0)
        self.stopping.set()

    # ---- jobs -------------------------------------------------------------------------------------------

    def take(self, msg: Msg, kind: type[PrefillJob] | type[DecodeJob]):  # -> kind | None
        """Decode a job message (raises on a malformed one) and register it in hand; None when there is
        nothing to do: its attempt was cancelled (acked: done), or it is a redelivery of a job in hand (its
        newer message replaces the old one, which JetStream no longer tracks)."""
        try:
            job = decode(msg.data, kind)
        except msgspec.ValidationError:  # out of the wire's ranges: refused when it says where to answer
            if self.refused_undecodable(msg, kind):
                return None
            raise  # malformed: the job loop drops it
        if self.refused(msg, job):
            return None
        if self.is_cancelled(job.request_id, job.attempt):
            log.info("dropping job %s: attempt %d was cancelled", job.request_id, job.attempt)
            asyncio.create_task(_settle(msg.ack()))
            return None
        if job.key in self.unacked:  # redelivered while in hand: its newer message is the one to settle
            self.unacked[job.key] = msg
            log.info("job %s redelivered while in hand here; keeping the one running", job.key)
            return None
        if job.key in self.engine.engine.requests:  # running here already (its ack was lost): done by this one
            log.info("job %s redelivered while it runs here; acking the copy", job.key)
            asyncio.create_task(_settle(msg.ack()))
            return None
        self.unacked[job.key] = msg
        return job

    def refused(self, msg: Msg, job: PrefillJob | DecodeJob) -> bool:
        """True for a job the engine must not see (shared/job_checks.py: it would fail on the engine thread):
        terminated, with a warning naming why and an error event back where its reply subject allows."""
        engine = self.engine.engine
        refusal = job_refusal(job, engine.model.config.vocab_size, engine.max_model_len)
        if refusal is None:
            return False
        log.warning("refusing job %.80r on %s: %s", job.request_id, msg.subject, refusal.reason)
        if refusal.reply:
            self.emit(job.reply_subject, error_event(job, refusal.reason, self.settings.worker_id))
        asyncio.create_task(_settle(msg.term()))
        return True

    def refused_undecodable(self, msg: Msg, kind: type[PrefillJob] | type[DecodeJob]) -> bool:
        """True for a job that failed validation (e.g. a temperature of -1) but names a request and a token
        subject: terminated, with a warning and an error event back, as `refused` does for a decoded one."""
        answer = undecodable_job_refusal(msg.data, kind)
        if answer is None:
            return False
        job, refusal = answer
        log.warning("refusing job %.80r on %s: %s", job.request_id, msg.subject, refusal.reason)
        self.emit(job.reply_subject, error_event(job, refusal.reason, self.settings.worker_id))
        asyncio.create_task(_settle(msg.term()))
        return True

    def announce(self, job: PrefillJob | DecodeJob) -> None:
        """Tell the gateway this worker holds the request now."""
        seq = len(job.output_token_ids)
        self.emit(job.reply_subject, TokenEvent.taken(job.request_id, job.attempt, seq, self.settings.worker_id))

    async def ack(self, key: str) -> None:
        msg = self.unacked.pop(key, None)
        if msg is not None:
            await _settle(msg.ack())

    async def term(self, key: str) -> None:
        """The job can never succeed (refused): JetStream must not redeliver it."""
        msg = self.unacked.pop(key, None)
        if msg is not None:
            await _settle(msg.term())

    def is_cancelled(self, request_id: str, attempt: int) -> bool:
        entry = self._cancelled.get(request_id)
        return entry is not None and (entry[0] is None or attempt <= entry[0])

    def _remember(self, cancel: Cancel) -> None:
        now = time.monotonic()
        old = self._cancelled.pop(cancel.request_id, None)
        up_to = cancel.up_to_attempt
        if old is not None and (old[0] is None or (up_to is not None and old[0] > up_to)):
            up_to = old[0]
        self._cancelled[cancel.request_id] = (up_to, now)
        while self._cancelled and (
            len(self._cancelled) > MAX_REMEMBERED_CANCELS
            or next(iter(self._cancelled.values()))[1] < now - CANCEL_MEMORY_S
        ):
            self._cancelled.popitem(last=False)

    async def _learn_ack_wait(self, consumer) -> None:
        """The shared consumer keeps the ack_wait it was created with (JetStream does not change it when a worker
        binds with another): progress is reported by the one in force."""
        try:
            ack_wait = (await consumer.consumer_info()).config.ack_wait
        except Exception as exc:
            log.warning("could not read the job consumer's ack_wait (%s); assuming job_ack_wait_s", exc)
            return
        if ack_wait and abs(ack_wait - self.settings.job_ack_wait_s) > 0.01:
            log.warning(
                "the job consumer's ack_wait is %g s, not job_ack_wait_s=%g s (it was created with it; delete the "
                "consumer to change it): progress is reported by %g s",
                ack_wait,
                self.settings.job_ack_wait_s,
                ack_wait,
            )
        self._ack_wait_s = ack_wait or self.settings.job_ack_wait_s

    async def _progress_reports(self) -> None:
        """Keep JetStream from redelivering the jobs in hand while this worker is alive."""
        while True:
            await asyncio.sleep(self._ack_wait_s / 3)
            for msg in list(self.unacked.values()):
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _job_loop(self) -> None:
        consumer = await bus.job_consumer(self.js, self.job_subject(), ack_wait_s=self.settings.job_ack_wait_s)
        await self._learn_ack_wait(consumer)
        while not self.stopping.is_set():
            if self.draining or not self.has_room():
                await asyncio.sleep(0.005)
                continue
            try:
                msgs = await consumer.fetch(batch=1, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:  # NATS restarting: wait and retry, never die
                log.warning("fetching jobs failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await self.handle_job(msg)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.error("dropping malformed job on %s: %s", msg.subject, exc)
                    await _settle(msg.term())
                except Exception:  # a bug on one job must not end the loop that takes every later one
                    log.exception("handling a job on %s failed; dropping it", msg.subject)
                    self.unacked = {key: m for key, m in self.unacked.items() if m is not msg}
                    await _settle(msg.term())

    async def _cancel_received(self, msg: Msg) -> None:
        cancel = decode_or_drop(msg.data, Cancel, msg.subject)
        if cancel is not None:
            self._remember(cancel)
            await self.on_cancel(cancel)

    def _outputs_ready(self, outputs: list[RequestOutput]) -> None:
        try:
            self.handle_outputs(outputs)
        except Exception:
            log.exception("handling engine outputs failed")

    def emit(self, subject: str, event: TokenEvent) -> None:
        """Queue a token event for publishing (callable from the loop without awaiting)."""
        self._outbox.put_nowait((subject, event))

    async def _publisher(self) -> None:
        while True:
            subject, event = await self._outbox.get()
            try:
                await self.nc.publish(subject, encode(event))
            except Exception as exc:  # the gateway's deadline turns a lost event into a clear error
                log.warning("publishing tokens for %s failed: %s", event.request_id, exc)

    def process_span(self, msg: Msg, request_id: str) -> Span:
        """The `process <subject>` span of a job just fetched, child of its publisher's span."""
        try:
            delivered = msg.metadata.num_delivered
        except nats.errors.NotJSMessageError:  # a core-NATS message (tests, tools): first delivery
            delivered = 1
        return tracing.consumer_span(msg.subject, msg.headers, request_id, self.settings.worker_id, delivered)

    def record_prefill(self, job: PrefillJob, out: RequestOutput, parent: Span) -> None:
        """A request's first output (its prompt is computed): the `prefill` span, from its first scheduling
        to now, and the queue-time and prompt-token metrics."""
        now = time.time()
        scheduled_at = out.scheduled_at or now
        attributes = {tracing.REQUEST_ID: job.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: out.num_prompt_tokens}
        if job.created_at:  # the gateway's clock: another machine's, so clamp a skew below zero
            queue_s = max(0.0, scheduled_at - job.created_at)
            attributes[tracing.QUEUE_TIME] = queue_s
            metrics.QUEUE_TIME.labels(*self.labels).observe(queue_s)
        metrics.PROMPT_TOKENS.labels(*self.labels).inc(out.num_prompt_tokens)
        span = tracing.start_span(f"{tracing.PREFILL} {self.model_name}", parent, scheduled_at, attributes=attributes)
        tracing.end_span(span, now)

    async def _engine_facts(self) -> None:
        """Integrity and expert load from the engine thread, between its steps (a long step delays this,
        never the heartbeat: the gateway judges liveness by the beat)."""
        while True:
            self._integrity, expert_load = await self.engine.call(_beat_facts)
            metrics.record_expert_load(self.model_name, self.role, expert_load)
            await asyncio.sleep(HEARTBEAT_S)

    async def _heartbeats(self) -> None:
        while True:
            e = self.engine.engine
            metrics.REQUESTS_RUNNING.labels(*self.labels).set(e.num_running)
            metrics.REQUESTS_WAITING.labels(*self.labels).set(e.num_waiting)
            metrics.KV_CACHE_USAGE.labels(*self.labels).set(e.blocks.usage)
            beat = Heartbeat(
                worker_id=self.settings.worker_id,
                role=self.role,
                model=self.model_name,
                rpc_address=self.rpc_address,
                running=e.num_running,
                waiting=e.num_waiting,
                free_blocks=e.blocks.num_free,
                total_blocks=e.blocks.num_blocks,
                prefill_tokens=e.stats.prefill_tokens,
                decode_tokens=e.stats.decode_tokens,
                held_kv=self.held_kv_count(),
                integrity_error=self._integrity,
                block_size=e.config.block_size,
                draining=self.draining,
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(heartbeat_subject(self.role, self.settings.worker_id), encode(beat))
            await asyncio.sleep(HEARTBEAT_S)


class StreamingWorker(Worker):
    """A role that runs requests to their end and streams every token back (decode, mixed). `streams`
    holds the job of each request it owns, by attempt key (the engine's request id)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.streams: dict[str, PrefillJob | DecodeJob] = {}
        self.decode_spans: dict[str, Span] = {}  # by attempt key, while it decodes here

    def start_decode_span(self, job: PrefillJob | DecodeJob, parent: Span, start_s: float | None = None) -> None:
        self.decode_spans[job.key] = tracing.start_span(
            f"{tracing.DECODE} {self.model_name}",
            parent,
            start_s,
            attributes={tracing.REQUEST_ID: job.request_id, tracing.WORKER_ID: self.settings.worker_id},
        )

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        tokens = metrics.GENERATION_TOKENS.labels(*self.labels)
        for out in outputs:
            job = self.streams.get(out.request_id)
            if job is None:
                continue  # cancelled meanwhile
            self.on_output(job, out)
            tokens.inc(len(out.new_token_ids))
            if out.finished:
                del self.streams[out.request_id]
                self._end_decode_span(out)
            self.emit(job.reply_subject, token_event(job.request_id, job.attempt, out, self.settings.worker_id))

    def on_output(self, job: PrefillJob | DecodeJob, out: RequestOutput) -> None:
        """Called for every output before it is published (the mixed role records its prefill on the first)."""

    def _end_decode_span(self, out: RequestOutput) -> None:
        span = self.decode_spans.pop(out.request_id, None)
        if span is None:
            return
        reason = out.finish_reason.value if out.finish_reason else "length"
        span.set_attribute(tracing.GEN_AI_USAGE_OUTPUT_TOKENS, out.num_output_tokens)
        span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH_REASONS, (reason,))
        tracing.end_span(span)

    async def on_cancel(self, cancel: Cancel) -> None:
        for key, job in list(self.streams.items()):
            if job.request_id == cancel.request_id and cancel.covers(job.attempt):
                del self.streams[key]
                await self.engine.call(lambda e, key=key: e.abort(key))
                span = self.decode_spans.pop(key, None)
                if span is not None:
                    span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH_REASONS, ("abort",))
                    tracing.end_span(span, error="cancelled")


def token_event(request_id: str, attempt: int, out: RequestOutput, worker_id: str) -> TokenEvent:
    """The wire event of one engine output: its new tokens, and the end when it finished."""
    seq = out.num_output_tokens - len(out.new_token_ids)
    if out.finished:
        reason = wire_finish_reason(out.finish_reason)
        return TokenEvent.finished(
            request_id, attempt, seq, out.new_token_ids, reason, worker_id, out.num_prompt_tokens
        )
    return TokenEvent.tokens(request_id, attempt, seq, out.new_token_ids, worker_id, out.num_prompt_tokens)


def wire_finish_reason(reason: EngineFinishReason | None) -> FinishReason:
    """The engine's reason as the wire says it; a finished output without one ran out of length."""
    return FinishReason(reason.value) if reason is not None else FinishReason.LENGTH


def error_event(job: PrefillJob | DecodeJob, message: str, worker_id: str, status: int = 400) -> TokenEvent:
    """The request was refused (by default as a client mistake the gateway could not see, e.g. a worker
    with a shorter max_model_len)."""
    return TokenEvent.failed(job.request_id, job.attempt, message, status, worker_id)


async def _settle(ack) -> None:
    """Await an ack / term / in-progress report; NATS being away only means JetStream redelivers later."""
    try:
        await ack
    except Exception as exc:
        log.warning("could not settle a job message: %s", exc)
