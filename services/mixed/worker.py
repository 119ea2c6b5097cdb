"""The mixed worker: prefill and decode in one engine, no KV transfer. The colocated baseline that
benchmarks compare disaggregation against; it takes jobs from the same prefill queue.

A request's entry: PREFILLING (added to the engine; its process span open until the engine took it) →
RUNNING (first token out: prefill recorded, decode span open) → forgotten with its last token."""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from shared.engine.engine import RequestOutput
from shared.messages import PrefillJob, Role, prefill_subject, routed_prefill_subject
from shared.worker import Entry, Phase, StreamingWorker, sampling_params, spans
from shared.worker.choices import engine_choices


class MixedWorker(StreamingWorker[PrefillJob]):
    role = Role.MIXED

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    def own_job_subject(self) -> str:
        return routed_prefill_subject(self.model_name, self.settings.worker_id)

    async def handle_job(self, msg: Msg) -> None:
        # Registered before the engine sees it: its first outputs may reach the loop before this resumes.
        # n > 1: the prompt is computed once, the other choices forked from its KV
        entries = await self.take_choices(msg, PrefillJob, Phase.PREFILLING)
        if not entries:
            return
        entry, job, live = entries[0], entries[0].job, [e.job for e in entries]
        try:
            # a request moved here mid-stream resumes after its tokens so far (each job's output_token_ids)
            choices = engine_choices(live, [sampling_params(j.sampling) for j in live])
            await self.engine.call(lambda e: e.add_group(job.prompt_token_ids, choices, cache_salt=job.cache_salt))
        except Exception as exc:  # ValueError: refused (the gateway validates; a last line of defence); else a bug
            for e in entries:
                await self.fail(e, exc)
            return
        await self.ledger.ack(job.key)
        spans.end_once(entry.span)

    def on_output(self, entry: Entry[PrefillJob], out: RequestOutput) -> None:
        if entry.phase is Phase.PREFILLING:  # its first output: the prompt is computed
            entry.phase = Phase.RUNNING
            if entry.group_key is None:  # a group's prompt is computed once, by its first choice
                spans.record_prefill(entry.job, out, entry.span, self.labels)
            self.start_decode_span(entry, entry.span, time.time())
