"""The mixed worker: prefill and decode in one engine, no KV transfer. The colocated baseline that
benchmarks compare disaggregation against; it takes jobs from the same prefill queue."""

from __future__ import annotations

import logging

from nats.aio.msg import Msg

from shared.messages import PrefillJob, decode, prefill_subject
from shared.worker import StreamingWorker, error_event, sampling_params

log = logging.getLogger(__name__)


class MixedWorker(StreamingWorker):
    role = "mixed"

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    async def handle_job(self, msg: Msg) -> None:
        job = decode(msg.data, PrefillJob)
        # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
        self.streams[job.request_id] = job
        try:
            params = sampling_params(job.sampling)
            await self.engine.call(lambda e: e.add_request(job.request_id, job.prompt_token_ids, params))
        except ValueError as exc:  # the gateway validates; this is a last line of defence
            del self.streams[job.request_id]
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id))
            await msg.term()
            return
        await msg.ack()
