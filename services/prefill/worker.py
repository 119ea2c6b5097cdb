"""The prefill worker: runs prompts to their first token, keeps the KV under a lease, hands off to decode.

Per job: announce it (this worker holds the request), add the prompt with max_tokens=1 and hold_kv →
first token → publish it (TTFT), hold the KV (HeldKv: its Redis location and lease), publish the decode job,
ack the prefill job, tell the gateway the request is queued for decode. The blocks stay pinned until a decode
worker's pull completes, the lease expires or the attempt is cancelled: HeldKv (shared/kv/held.py) owns them
from the hold on (held → sending → freed). Everything inside the worker is keyed by the job's attempt key
(engine request, held KV, Redis entry). A job's ledger entry: PREFILLING (in the engine) → HANDING_ON (first
token out; `_hand_off` owns it) → forgotten once the decode job is published and the prefill job acked.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from shared.engine.engine import RequestOutput
from shared.engine.request import FinishReason
from shared.kv.held import HeldKv
from shared.kv.registry import KvLocation, KvRegistry
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.server import KvTransferServer
from shared.kv.transfer.source import EngineKvBlocks
from shared.messages import Cancel, DecodeJob, PrefillJob, Role, decode_subject, encode, prefill_subject
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, Worker, sampling_params, spans
from shared.worker.events import first_token_event, queued_event

log = logging.getLogger(__name__)


class PrefillWorker(Worker[PrefillJob]):
    role = Role.PREFILL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # KV held for a pull, by attempt key (state, lease timer, Redis entry); built once Redis is connected
        self.held: HeldKv | None = None
        self.server: KvTransferServer | None = None

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    def held_kv_count(self) -> int:
        return 0 if self.held is None else self.held.count()

    async def setup(self) -> None:
        kv = self.settings.kv
        # one stream for this server's exports and sends, off the engine's compute stream (a no-op on CPU)
        stream = SendStream(self.engine.engine.device)
        blocks = EngineKvBlocks(self.engine.engine, call=self.engine.call, send_stream=stream)
        self.held = HeldKv(blocks, kv.lease_s, registry=KvRegistry(self.conn.redis, kv.lease_s))
        self.server = KvTransferServer(
            kv.rpc_host,
            kv.rpc_port,
            source=self.held,
            secret=self.settings.ticket_secret,
            backend=kv.backend,
            timeout_s=kv.timeout_s,
            chunk_bytes=kv.chunk_bytes,
            fault_send_midway=kv.fault_send_midway,
            advertise_host=kv.advertise_host,
            model_name=self.model_name,
            send_stream=stream,
        )
        self.rpc_address = await self.server.start()

    async def teardown(self) -> None:
        if self.server is not None:
            await self.server.stop()  # waits for sends in flight
        if self.held is not None:
            await self.held.release_all()

    async def handle_job(self, msg: Msg) -> None:
        # Registered before the engine sees it: the first token may reach the loop before this resumes.
        entry = await self.take(msg, PrefillJob, Phase.PREFILLING)
        if entry is None:
            return
        job = entry.job
        try:
            # one token more than it has: a request moved here mid-stream resumes after its tokens so far
            outputs = job.output_token_ids
            # max_tokens 0: score the prompt only (prompt logprobs), nothing to sample or hand on
            params = sampling_params(job.sampling, max_tokens=len(outputs) + 1 if job.sampling.max_tokens else 0)
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

    async def _hand_off(self, entry: Entry[PrefillJob], out: RequestOutput) -> None:
        job, span = entry.job, entry.span
        spans.record_prefill(job, out, span, self.labels)
        metrics.GENERATION_TOKENS.labels(*self.labels).inc(len(out.new_token_ids))
        with tracing.use_span(span):  # log lines and the decode publish join its trace
            try:
                await self._hand_on(job, out)
            except Exception as exc:  # NATS away: the job stays unacked, so JetStream hands it out again
                log.warning("handing %s on to decode failed (%s); freeing its KV", job.key, exc)
                tracing.mark_error(span, str(exc))
                if self.held is not None:
                    await self.held.release(job.key)
                await self.engine.call(lambda e: e.release_kv(job.key))
                self.ledger.pop(job.key)
        spans.end_once(span)

    async def _hand_on(self, job: PrefillJob, out: RequestOutput) -> None:
        """Publish the first token; hold the KV and publish the decode job (or free it: nothing to decode)."""
        assert self.held is not None  # set up before any job is taken
        rid, key = job.request_id, job.key
        finished = out.finish_reason is FinishReason.STOP or out.num_output_tokens >= job.sampling.max_tokens
        worker_id = self.settings.worker_id
        reason = out.finish_reason if finished else None
        self.emit(job.reply_subject, first_token_event(job, out, finished, reason, worker_id))
        if finished or self.is_cancelled(rid, job.attempt):  # nothing left to decode here
            await self.engine.call(lambda e: e.release_kv(key))
            self.ledger.finish(key)
            return
        fingerprint = self.held.layout.fingerprint
        location = KvLocation(key, worker_id, self.rpc_address or "", out.num_prompt_tokens, fingerprint)
        # False: Redis unreachable, so no decode worker could find the KV: it is freed and decode recomputes
        holder = worker_id if await self.held.hold(key, rid, job.attempt, location) else None
        decode_job = DecodeJob(
            request_id=rid,
            model=job.model,
            prompt_token_ids=job.prompt_token_ids,
            output_token_ids=[*job.output_token_ids, *out.new_token_ids],
            sampling=job.sampling,
            reply_subject=job.reply_subject,
            attempt=job.attempt,
            prefill_worker=holder,
            created_at=job.created_at,
        )
        subject = decode_subject(self.model_name)
        with tracing.producer_span(subject, rid):
            await self.conn.js.publish(subject, encode(decode_job), headers=tracing.carrier() or None)
        self.ledger.finish(key)
        self.emit(job.reply_subject, queued_event(job, worker_id))  # no worker holds it until a decode worker does

    async def on_cancel(self, cancel: Cancel) -> None:
        await super().on_cancel(cancel)  # the jobs in hand
        if self.held is not None:  # the KV held for a pull; KV being sent is freed when its send ends
            await self.held.cancel(cancel.request_id, cancel.covers)
