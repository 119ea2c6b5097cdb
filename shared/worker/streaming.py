"""Roles that run requests to their end and stream every token back (decode, mixed). A request's entry stays
in the ledger while it is in the engine; its last output forgets it."""

from __future__ import annotations

from opentelemetry.trace import Span

from shared.engine.engine import RequestOutput
from shared.messages import Job
from shared.telemetry import metrics
from shared.worker import spans
from shared.worker.events import token_event
from shared.worker.ledger import Entry
from shared.worker.runtime import Worker


class StreamingWorker(Worker[Job]):
    def start_decode_span(self, entry: Entry[Job], parent: Span, start_s: float | None = None) -> None:
        entry.decode_span = spans.start_decode_span(
            entry.job, parent, self.model_name, self.settings.worker_id, start_s
        )

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        tokens = metrics.GENERATION_TOKENS.labels(*self.labels)
        for out in outputs:
            entry = self.ledger.get(out.request_id)
            if entry is None:
                continue  # cancelled meanwhile
            self.on_output(entry, out)
            tokens.inc(len(out.new_token_ids))
            if out.finished:
                self.ledger.finish(out.request_id)
                spans.end_decode_span(entry.decode_span, out)
            job = entry.job
            self.emit(job.reply_subject, token_event(job.request_id, job.attempt, out, self.settings.worker_id))

    def on_output(self, entry: Entry[Job], out: RequestOutput) -> None:
        """Called for every output before it is published (the mixed role records its prefill on the first)."""
