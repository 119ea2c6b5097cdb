"""The mixed worker: prefill and decode in one engine, no KV transfer. The colocated baseline that
benchmarks compare disaggregation against; it takes jobs from the same prefill queue."""

from __future__ import annotations

import logging

from nats.aio.msg import Msg

from shared.engine.engine import RequestOutput
from shared.messages import PrefillJob, decode, prefill_subject
from shared.worker import Worker, error_event, sampling_params, token_event

log = logging.getLogger(__name__)


class MixedWorker(Worker):
    role = "mixed"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jobs: dict[str, PrefillJob] = {}

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    async def handle_job(self, msg: Msg) -> None:
        job = decode(msg.data, PrefillJob)
        # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
        self.jobs[job.request_id] = job
        try:
            params = sampling_params(job.sampling)
            await self.engine.call(lambda e: e.add_request(job.request_id, job.prompt_token_ids, params))
        except ValueError as exc:  # the gateway validates; this is a last line of defence
            del self.jobs[job.request_id]
            self.emit(job.reply_subject, error_event(job, str(exc), self.settings.worker_id))
            await msg.term()
            return
        await msg.ack()

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue  # cancelled meanwhile
            if out.finished:
                del self.jobs[out.request_id]
            self.emit(job.reply_subject, token_event(job.request_id, job.attempt, out, self.settings.worker_id))

    async def on_cancel(self, request_id: str) -> None:
        if self.jobs.pop(request_id, None) is not None:
            await self.engine.call(lambda e: e.abort(request_id))
