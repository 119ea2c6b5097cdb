"""The prefill worker: runs prompts to their first token, keeps the KV under a lease, hands off to decode.

Per job: announce it (this worker holds the request), add the prompt with max_tokens=1 and hold_kv →
first token → publish it (TTFT), write the KV location to Redis, publish the decode job, ack the prefill
job, tell the gateway the request is queued for decode. The blocks stay pinned until a decode worker's
pull completes (the transfer server releases them), the lease expires or the attempt is cancelled.
Ownership of a request's blocks: prefilling (engine) → held (this worker, lease running) → pulled → freed.
Everything inside the worker is keyed by the job's attempt key (engine request, held KV, Redis entry).
A job's ledger entry: PREFILLING (in the engine) → HANDING_ON (first token out; `_hand_off` owns it) →
forgotten once the decode job is published and the prefill job acked; the held KV is tracked apart.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from shared.engine.engine import RequestOutput
from shared.engine.request import FinishReason
from shared.kv.registry import KvLocation, KvRegistry
from shared.kv.transfer.server import KvTransferServer
from shared.kv.transfer.source import EngineKvSource
from shared.messages import Cancel, DecodeJob, PrefillJob, decode_subject, encode, prefill_subject
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, Worker, sampling_params, spans
from shared.worker.events import first_token_event, queued_event

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.holding: dict[str, PrefillJob] = {}  # KV held for a pull, by attempt key
        # Held KV behind pull tickets; the transfer server exports and releases through it.
        self.source = EngineKvSource(self.engine.engine, call=self.engine.call, on_release=self._released)
        self.registry: KvRegistry | None = None
        self.server: KvTransferServer | None = None

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    def held_kv_count(self) -> int:
        return len(self.source.held)

    async def setup(self) -> None:
        self.registry = KvRegistry(self.redis, self.settings.kv_lease_s)
        self.server = KvTransferServer(
            self.settings.rpc_host,
            self.settings.rpc_port,
            source=self.source,
            secret=self.settings.cluster_secret,
            backend=self.settings.transfer_backend,
            timeout_s=self.settings.kv_transfer_timeout_s,
            chunk_bytes=self.settings.kv_chunk_bytes,
            fault_send_midway=self.settings.fault_kv_send_midway,
            advertise_host=self.settings.advertise_host,
            model_name=self.model_name,
        )
        self.rpc_address = await self.server.start()

    async def teardown(self) -> None:
        if self.server is not None:
            await self.server.stop()
        for request_id in self.source.held:
            await self.source.release_kv(request_id)

    async def handle_job(self, msg: Msg) -> None:
        # Registered before the engine sees it: the first token may reach the loop before this resumes.
        entry = await self.take(msg, PrefillJob, Phase.PREFILLING)
        if entry is None:
            return
        job = entry.job
        try:
            # one token more than it has: a request moved here mid-stream resumes after its tokens so far
            outputs = job.output_token_ids
            params = sampling_params(job.sampling, max_tokens=len(outputs) + 1)
            await self.engine.call(
                lambda e: e.add_request(job.key, job.prompt_token_ids, params, hold_kv=True, output_token_ids=outputs)
            )
        except Exception as exc:  # ValueError: the engine refused the job; anything else: a bug, answered as such
            await self.fail(entry, exc)

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self.ledger.get(out.request_id)
            if entry is not None and entry.phase is Phase.PREFILLING:
                entry.phase = Phase.HANDING_ON
                asyncio.create_task(self._hand_off(entry, out))

    async def _hand_off(self, entry: Entry, out: RequestOutput) -> None:
        job, span = entry.job, entry.span
        spans.record_prefill(job, out, span, self.labels)
        metrics.GENERATION_TOKENS.labels(*self.labels).inc(len(out.new_token_ids))
        with tracing.use_span(span):  # log lines and the decode publish join its trace
            try:
                await self._hand_on(job, out)
            except Exception as exc:  # NATS away: the job stays unacked, so JetStream hands it out again
                log.warning("handing %s on to decode failed (%s); freeing its KV", job.key, exc)
                tracing.mark_error(span, str(exc))
                await self.source.release_kv(job.key)
                await self.engine.call(lambda e: e.release_kv(job.key))
                self.ledger.pop(job.key)
        spans.end_once(span)

    async def _hand_on(self, job: PrefillJob, out: RequestOutput) -> None:
        """Publish the first token; hold the KV and publish the decode job (or free it: nothing to decode)."""
        rid, key = job.request_id, job.key
        token = out.new_token_ids[0]
        finished = out.finish_reason is FinishReason.STOP or out.num_output_tokens >= job.sampling.max_tokens
        reason = (out.finish_reason.value if out.finish_reason else "length") if finished else None
        worker_id = self.settings.worker_id
        self.emit(job.reply_subject, first_token_event(job, token, reason, out.num_prompt_tokens, worker_id))
        if finished or self.is_cancelled(rid, job.attempt):  # nothing left to decode here
            await self.engine.call(lambda e: e.release_kv(key))
            self.ledger.finish(key)
            return
        self.source.hold(key)
        self.holding[key] = job
        fingerprint = self.source.layout.fingerprint
        holder: str | None = self.settings.worker_id
        try:
            await self.registry.put(
                KvLocation(key, self.settings.worker_id, self.rpc_address, out.num_prompt_tokens, fingerprint)
            )
        except Exception as exc:  # Redis unreachable: no decode worker could find the KV, so do not hold it
            log.warning("could not record the KV location of %s (%s); decode will recompute", key, exc)
            await self.source.release_kv(key)
            holder = None
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
        self.ledger.finish(key)
        self.emit(job.reply_subject, queued_event(job, worker_id))  # no worker holds it until a decode worker does
        if holder is not None:
            asyncio.get_running_loop().call_later(self.settings.kv_lease_s, self._expire, key)

    def _expire(self, key: str) -> None:
        if key in self.source.held and not self.source.is_sending(key):
            log.warning("KV lease of %s expired before any pull; freeing its blocks", key)
            asyncio.create_task(self.source.release_kv(key))

    async def _released(self, key: str) -> None:
        self.holding.pop(key, None)
        try:
            await self.registry.delete(key)
        except Exception as exc:  # the entry's TTL removes it anyway
            log.warning("could not delete the KV location of %s: %s", key, exc)

    async def on_cancel(self, cancel: Cancel) -> None:
        await super().on_cancel(cancel)  # the jobs in hand
        await self._drop_held(cancel)

    async def _drop_held(self, cancel: Cancel) -> None:
        """Free the KV this worker holds for an attempt `cancel` covers (unless a pull is sending it now)."""
        for key, job in list(self.holding.items()):
            if job.request_id == cancel.request_id and cancel.covers(job.attempt) and not self.source.is_sending(key):
                await self.source.release_kv(key)
