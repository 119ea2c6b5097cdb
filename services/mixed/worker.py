"""The mixed worker: prefill and decode in one engine, no KV transfer. The colocated baseline that
benchmarks compare disaggregation against; it takes jobs from the same prefill queue."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from shared.engine.engine import RequestOutput
from shared.messages import Cancel, PrefillJob, Role, prefill_subject
from shared.telemetry import tracing
from shared.worker import StreamingWorker, error_event, sampling_params

log = logging.getLogger(__name__)


class MixedWorker(StreamingWorker):
    role = Role.MIXED

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefilling: dict[str, Span] = {}  # attempt key → its process span, until the first token

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    async def handle_job(self, msg: Msg) -> None:
        job = self.take(msg, PrefillJob)
        if job is None:
            return
        self.announce(job)
        span = self.process_span(msg, job.request_id)
        # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
        self.streams[job.key] = job
        self.prefilling[job.key] = span
        try:
            params = sampling_params(job.sampling)
            outputs = job.output_token_ids  # a request moved here mid-stream resumes after them
            await self.engine.call(
                lambda e: e.add_request(job.key, job.prompt_token_ids, params, output_token_ids=outputs)
            )
        except Exception as exc:  # ValueError: refused (the gateway validates; a last line of defence); else a bug
            status = 400 if isinstance(exc, ValueError) else 500
            if status == 500:
                log.exception("adding %s failed", job.key)
            del self.streams[job.key]
            del self.prefilling[job.key]
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id, status=status))
            await self.term(job.key)
            tracing.end_span(span, error=str(exc))
            return
        await self.ack(job.key)
        span.end()

    def on_output(self, job: PrefillJob, out: RequestOutput) -> None:
        parent = self.prefilling.pop(out.request_id, None)
        if parent is not None:
            self.record_prefill(job, out, parent)
            self.start_decode_span(job, parent, time.time())

    async def on_cancel(self, cancel: Cancel) -> None:
        for key, job in list(self.streams.items()):
            if job.request_id == cancel.request_id and cancel.covers(job.attempt):
                self.prefilling.pop(key, None)
        await super().on_cancel(cancel)
