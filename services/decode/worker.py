"""The decode worker: takes prefilled requests, pulls their KV from the prefill worker, decodes.

Per job: read the KV location from Redis, pull the blocks over the pair's channel (negotiated over
gRPC), import them into freshly allocated blocks, ack, and stream tokens until the request finishes.
Pulls run as tasks on the event loop while the engine thread keeps stepping the running batch. When the
KV cannot be had (no location, transfer failed, no room), the request is recomputed from its prompt and
the tokens so far (policy `recompute`).
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from shared.engine.block_manager import NoFreeBlocksError
from shared.kv.registry import KvRegistry
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.messages import DecodeJob, decode, decode_subject
from shared.telemetry import metrics, tracing
from shared.worker import StreamingWorker, error_event, sampling_params

log = logging.getLogger(__name__)
MAX_CONCURRENT_PULLS = 4


class DecodeWorker(StreamingWorker):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admitting: set[str] = set()  # pulls in flight
        self.registry: KvRegistry | None = None
        self.client: KvTransferClient | None = None

    def job_subject(self) -> str:
        return decode_subject(self.model_name)

    async def setup(self) -> None:
        self.registry = KvRegistry(self.redis, self.settings.kv_lease_s)
        self.client = KvTransferClient(
            self.settings.worker_id, backend=self.settings.transfer_backend, model_name=self.model_name
        )

    async def teardown(self) -> None:
        if self.client is not None:
            await self.client.close()

    def has_room(self) -> bool:
        return super().has_room() and len(self.admitting) < MAX_CONCURRENT_PULLS

    async def handle_job(self, msg: Msg) -> None:
        job = decode(msg.data, DecodeJob)
        span = self.process_span(msg, job.request_id)
        self.admitting.add(job.request_id)
        asyncio.create_task(self._admit_traced(job, msg, span))

    async def _admit_traced(self, job: DecodeJob, msg: Msg, span: Span) -> None:
        with tracing.use_span(span, end_on_exit=True):  # the pull's span and log lines join the request's trace
            await self._admit(job, msg, span)

    async def _admit(self, job: DecodeJob, msg: Msg, span: Span) -> None:
        rid = job.request_id
        try:
            params = sampling_params(job.sampling)
            kv = await self._pull(job)
            if rid not in self.admitting:  # cancelled during the pull
                await msg.ack()
                return
            prompt, outputs = job.prompt_token_ids, job.output_token_ids
            # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
            self.streams[rid] = job
            self.start_decode_span(rid, span)
            try:
                if kv is None:
                    raise NoFreeBlocksError("no KV to import")
                await self.engine.call(lambda e: e.import_kv(rid, prompt, outputs, params, kv))
                self.client.recycle(kv)  # its receive buffer serves the next pull (no fresh page faults)
                span.set_attribute(tracing.KV_OUTCOME, "pulled")
            except NoFreeBlocksError:
                await self.engine.call(lambda e: e.add_request(rid, prompt, params, output_token_ids=outputs))
                span.set_attribute(tracing.KV_OUTCOME, "recompute")
                metrics.PROMPT_TOKENS.labels(*self.labels).inc(len(prompt))  # this engine computes the prompt
            await msg.ack()
        except ValueError as exc:
            self.streams.pop(rid, None)
            decode_span = self.decode_spans.pop(rid, None)
            if decode_span is not None:
                tracing.end_span(decode_span, error=str(exc))
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id))
            await msg.term()
            tracing.mark_error(span, str(exc))
        finally:
            self.admitting.discard(rid)

    async def _pull(self, job: DecodeJob):
        if job.prefill_worker is None:
            return None
        try:
            loc = await self.registry.get(job.request_id)
        except Exception as exc:  # Redis unreachable: the KV cannot be found, recompute
            log.warning("reading the KV location of %s failed (%s); recomputing", job.request_id, exc)
            return None
        if loc is None:
            log.warning("no KV location for %s (lease expired?); recomputing", job.request_id)
            return None
        try:
            return await self.client.pull(loc.rpc_address, job.request_id, loc.ticket, self.engine.engine.layout)
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s); recomputing", job.request_id, loc.worker_id, exc)
            return None

    async def on_cancel(self, request_id: str) -> None:
        self.admitting.discard(request_id)  # a pull in flight: _admit sees it and drops the request
        await super().on_cancel(request_id)
