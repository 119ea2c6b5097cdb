"""The prefill worker: runs prompts to their first token, keeps the KV under a lease, hands off to decode.

Per job: announce it (this worker holds the request), add the prompt with max_tokens=1 and hold_kv →
first token → publish it (TTFT), write the KV location to Redis, publish the decode job, ack the prefill
job, tell the gateway the request is queued for decode. The blocks stay pinned until a decode worker's
pull completes (the transfer server releases them), the lease expires or the attempt is cancelled.
Ownership of a request's blocks: prefilling (engine) → held (this worker, lease running) → pulled → freed.
Everything inside the worker is keyed by the job's attempt key (engine request, held KV, Redis entry).
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from shared.engine.engine import RequestOutput
from shared.engine.request import FinishReason
from shared.kv.held import HeldKv
from shared.kv.registry import KvLocation, KvRegistry
from shared.kv.transfer.server import KvTransferServer
from shared.kv.transfer.source import EngineKvBlocks
from shared.messages import Cancel, DecodeJob, PrefillJob, Role, TokenEvent, decode_subject, encode, prefill_subject
from shared.telemetry import metrics, tracing
from shared.worker import Worker, error_event, sampling_params, wire_finish_reason

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = Role.PREFILL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jobs: dict[str, tuple[PrefillJob, Span]] = {}  # prefilling, by attempt key; the job's process span
        # KV held for a pull, by attempt key (state, lease timer, Redis entry); built once Redis is connected
        self.held: HeldKv | None = None
        self.server: KvTransferServer | None = None

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    def held_kv_count(self) -> int:
        return 0 if self.held is None else self.held.count()

    async def setup(self) -> None:
        lease_s = self.settings.kv.lease_s
        blocks = EngineKvBlocks(self.engine.engine, call=self.engine.call)
        self.held = HeldKv(blocks, lease_s, registry=KvRegistry(self.redis, lease_s))
        self.server = KvTransferServer(
            self.settings.kv.rpc_host,
            self.settings.kv.rpc_port,
            source=self.held,
            secret=self.settings.cluster_secret,
            backend=self.settings.kv.backend,
            timeout_s=self.settings.kv.timeout_s,
            chunk_bytes=self.settings.kv.chunk_bytes,
            fault_send_midway=self.settings.kv.fault_send_midway,
            advertise_host=self.settings.kv.advertise_host,
            model_name=self.model_name,
        )
        self.rpc_address = await self.server.start()

    async def teardown(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.held is not None:  # after the server's stop: no send is left in flight
            await self.held.release_all()

    async def handle_job(self, msg: Msg) -> None:
        job = self.take(msg, PrefillJob)
        if job is None:
            return
        self.announce(job)
        span = self.process_span(msg, job.request_id)
        # Registered before the engine sees it: the first token may reach the loop before this resumes.
        self.jobs[job.key] = (job, span)
        try:
            # one token more than it has: a request moved here mid-stream resumes after its tokens so far
            outputs = job.output_token_ids
            params = sampling_params(job.sampling, max_tokens=len(outputs) + 1)
            await self.engine.call(
                lambda e: e.add_request(job.key, job.prompt_token_ids, params, hold_kv=True, output_token_ids=outputs)
            )
        except Exception as exc:  # ValueError: the engine refused the job; anything else: a bug, answered as such
            status = 400 if isinstance(exc, ValueError) else 500
            if status == 500:
                log.exception("adding %s failed", job.key)
            del self.jobs[job.key]
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id, status=status))
            await self.term(job.key)
            tracing.end_span(span, error=str(exc))

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self.jobs.pop(out.request_id, None)
            if entry is not None:
                asyncio.create_task(self._hand_off(*entry, out))

    async def _hand_off(self, job: PrefillJob, span: Span, out: RequestOutput) -> None:
        self.record_prefill(job, out, span)
        metrics.GENERATION_TOKENS.labels(*self.labels).inc(len(out.new_token_ids))
        with tracing.use_span(span, end_on_exit=True):  # log lines and the decode publish join its trace
            try:
                await self._hand_on(job, out)
            except Exception as exc:  # NATS away: the job stays unacked, so JetStream hands it out again
                log.warning("handing %s on to decode failed (%s); freeing its KV", job.key, exc)
                tracing.mark_error(span, str(exc))
                await self.held.release(job.key)
                await self.engine.call(lambda e: e.release_kv(job.key))
                self.unacked.pop(job.key, None)

    async def _hand_on(self, job: PrefillJob, out: RequestOutput) -> None:
        """Publish the first token; hold the KV and publish the decode job (or free it: nothing to decode)."""
        rid, key = job.request_id, job.key
        token, position = out.new_token_ids[0], len(job.output_token_ids)
        finished = out.finish_reason is FinishReason.STOP or out.num_output_tokens >= job.sampling.max_tokens
        worker, prompt_tokens = self.settings.worker_id, out.num_prompt_tokens
        if finished:
            reason = wire_finish_reason(out.finish_reason)
            event = TokenEvent.finished(rid, job.attempt, position, [token], reason, worker, prompt_tokens)
        else:
            event = TokenEvent.tokens(rid, job.attempt, position, [token], worker, prompt_tokens)
        self.emit(job.reply_subject, event)
        if finished or self.is_cancelled(rid, job.attempt):  # nothing left to decode here
            await self.engine.call(lambda e: e.release_kv(key))
            await self.ack(key)
            return
        worker = self.settings.worker_id
        location = KvLocation(key, worker, self.rpc_address, out.num_prompt_tokens, self.held.layout.fingerprint)
        # False: Redis unreachable, so no decode worker could find the KV: it is freed and decode recomputes
        holder = worker if await self.held.hold(key, rid, job.attempt, location) else None
        decode_job = DecodeJob(
            request_id=rid,
            model=job.model,
            prompt_token_ids=job.prompt_token_ids,
            output_token_ids=[*job.output_token_ids, token],
            sampling=job.sampling,
            reply_subject=job.reply_subject,
            attempt=job.attempt,
            prefill_worker=holder,
            created_at=job.created_at,
        )
        subject = decode_subject(self.model_name)
        with tracing.producer_span(subject, rid):
            await self.js.publish(subject, encode(decode_job), headers=tracing.carrier() or None)
        await self.ack(key)
        queued = TokenEvent.queued(rid, job.attempt, position + 1, self.settings.worker_id)
        self.emit(job.reply_subject, queued)  # no worker holds the request until a decode worker takes it

    async def on_cancel(self, cancel: Cancel) -> None:
        for key, (job, span) in list(self.jobs.items()):
            if job.request_id == cancel.request_id and cancel.covers(job.attempt):
                del self.jobs[key]
                await self.engine.call(lambda e, key=key: e.abort(key))
                await self.ack(key)  # the client is gone or the request moved on: this job is done
                tracing.end_span(span, error="cancelled")
        if self.held is not None:  # KV being sent is freed when its send ends
            await self.held.cancel(cancel.request_id, cancel.covers)
