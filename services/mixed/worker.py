"""The mixed worker: prefill and decode in one engine, no KV transfer. The colocated baseline that
benchmarks compare disaggregation against; it takes jobs from the same prefill queue."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from shared.engine.engine import RequestOutput
from shared.messages import PrefillJob, decode, prefill_subject
from shared.telemetry import tracing
from shared.worker import StreamingWorker, error_event, sampling_params

log = logging.getLogger(__name__)


class MixedWorker(StreamingWorker):
    role = "mixed"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefilling: dict[str, Span] = {}  # request id → its process span, until the first token

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    async def handle_job(self, msg: Msg) -> None:
        job = decode(msg.data, PrefillJob)
        span = self.process_span(msg, job.request_id)
        # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
        self.streams[job.request_id] = job
        self.prefilling[job.request_id] = span
        try:
            params = sampling_params(job.sampling)
            await self.engine.call(lambda e: e.add_request(job.request_id, job.prompt_token_ids, params))
        except ValueError as exc:  # the gateway validates; this is a last line of defence
            del self.streams[job.request_id]
            del self.prefilling[job.request_id]
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id))
            await msg.term()
            tracing.end_span(span, error=str(exc))
            return
        await msg.ack()
        span.end()

    def on_output(self, job: PrefillJob, out: RequestOutput) -> None:
        parent = self.prefilling.pop(out.request_id, None)
        if parent is not None:
            self.record_prefill(job, out, parent)
            self.start_decode_span(job.request_id, parent, time.time())

    async def on_cancel(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)
        await super().on_cancel(request_id)
