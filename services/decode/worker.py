"""The decode worker: takes prefilled requests, pulls their KV from the prefill worker, decodes.

Per job: read the KV location from Redis, pull the blocks over the pair's channel (negotiated over
gRPC), import them into freshly allocated blocks, ack, and stream tokens until the request finishes.
Pulls run as tasks on the event loop while the engine thread keeps stepping the running batch. When the
KV cannot be had (no location, transfer failed), the request is recomputed from its prompt and the tokens
so far (kv_fallback `recompute`), or fails with a clear error (`fail`). A job with nothing to pull (moved
here from a worker that died) and one with no room to import its KV are always recomputed.

A request's entry: PULLING (its KV pull in flight, owned by `_admit`) → RUNNING (in the engine) → forgotten
with its last token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from nats.aio.msg import Msg

from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.kv_export import KVExport
from shared.kv.registry import KvRegistry
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.messages import DecodeJob, Role, decode_subject
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, StreamingWorker, error_event, sampling_params, spans

log = logging.getLogger(__name__)
MAX_CONCURRENT_PULLS = 4


class DecodeWorker(StreamingWorker[DecodeJob]):
    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.registry: KvRegistry | None = None  # both set up once Redis is connected (setup)
        self.client: KvTransferClient | None = None

    def job_subject(self) -> str:
        return decode_subject(self.model_name)

    async def setup(self) -> None:
        self.registry = KvRegistry(self.conn.redis, self.settings.kv.lease_s)
        self.client = KvTransferClient(
            self.settings.worker_id,
            secret=self.settings.ticket_secret,
            backend=self.settings.kv.backend,
            timeout_s=self.settings.kv.timeout_s,
            model_name=self.model_name,
        )

    async def teardown(self) -> None:
        if self.client is not None:
            await self.client.close()

    def has_room(self) -> bool:
        return super().has_room() and self.ledger.count(Phase.PULLING) < MAX_CONCURRENT_PULLS

    async def handle_job(self, msg: Msg) -> None:
        entry = await self.take(msg, DecodeJob, Phase.PULLING)
        if entry is not None:
            asyncio.create_task(self._admit_traced(entry))

    async def _admit_traced(self, entry: Entry[DecodeJob]) -> None:
        with tracing.use_span(entry.span):  # the pull's span and log lines join the request's trace
            await self._admit(entry)
        spans.end_once(entry.span)

    async def _admit(self, entry: Entry[DecodeJob]) -> None:
        assert self.client is not None  # set up (setup) before any job is taken
        job, key, span = entry.job, entry.key, entry.span
        try:
            # the prefill worker reported the prompt's logprobs: a recomputation here need not score it again
            params = dataclasses.replace(sampling_params(job.sampling), prompt_logprobs=None)
            kv, failure = await self._pull(job)
            if entry.cancelled:  # during the pull
                self.ledger.finish(key)
                return
            if failure is not None and self.settings.kv.fallback == "fail":
                message = f"the request's KV could not be had ({failure}) and kv_fallback is 'fail'"
                self.emit(job.reply_subject, error_event(job, message, self.settings.worker_id, status=502))
                span.set_attribute(tracing.KV_OUTCOME, "failed")
                self.ledger.finish(key)  # answered: the job is done
                return
            prompt, outputs = job.prompt_token_ids, job.output_token_ids
            # Running before the engine sees it: its first outputs may reach the loop before this resumes.
            entry.phase = Phase.RUNNING
            self.start_decode_span(entry, span)
            try:
                if kv is None:
                    raise NoFreeBlocksError("no KV to import")
                await self.engine.call(lambda e: e.import_kv(key, prompt, outputs, params, kv))
                self.client.recycle(kv)  # its receive buffer serves the next pull (no fresh page faults)
                span.set_attribute(tracing.KV_OUTCOME, "pulled")
            except NoFreeBlocksError:
                await self.engine.call(lambda e: e.add_request(key, prompt, params, output_token_ids=outputs))
                span.set_attribute(tracing.KV_OUTCOME, "recompute")
                metrics.PROMPT_TOKENS.labels(*self.labels).inc(len(prompt))  # this engine computes the prompt
            await self.ledger.ack(key)
        except Exception as exc:  # ValueError: the job was refused; anything else: a bug, answered as such
            await self.fail(entry, exc)

    async def _pull(self, job: DecodeJob) -> tuple[KVExport | None, str | None]:
        """The job's KV from the prefill worker that holds it, or None and why it could not be had; (None, None)
        when there is nothing to pull."""
        assert self.registry is not None and self.client is not None  # set up (setup) before any job is taken
        if job.prefill_worker is None:
            return None, None
        key = job.key
        try:
            loc = await self.registry.get(key)
        except Exception as exc:  # Redis unreachable: the KV cannot be found
            log.warning("reading the KV location of %s failed (%s)", key, exc)
            return None, f"reading its location failed: {exc}"
        if loc is None:
            log.warning("no KV location for %s (lease expired?)", key)
            return None, f"no KV location (prefill worker {job.prefill_worker} freed it, or its lease expired)"
        try:
            return await self.client.pull(loc.rpc_address, key, self.engine.engine.layout), None
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, exc)
            return None, f"pulling it from {loc.worker_id} failed: {exc}"
