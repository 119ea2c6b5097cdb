"""Roles that run requests to their end and stream every token back (decode, mixed). A request's entry stays
in the ledger while it is in the engine; its last output forgets it.

Leaving the role (a switch, Worker.leave) a request still running here is handed on the way the gateway moves one
whose worker died, but from here and at once (`hand_on_in_hand`): taken out of the engine with the tokens it has
sampled, announced as queued (QueuedEvent: no worker holds it), and published to the prefill queue as its next
attempt carrying those tokens. A prefill worker recomputes prompt + tokens and samples the next one, a decode
worker goes on from there: no position is lost or repeated (the gateway delivers positions once, and the new
attempt starts where this one's events stop: they are all out before the job is published).
"""

from __future__ import annotations

import logging

from opentelemetry.trace import Span

from shared.engine.engine import Engine, RequestOutput
from shared.messages import DecodeJob, Job, PrefillJob, QueuedEvent, encode, prefill_subject
from shared.telemetry import metrics, tracing
from shared.worker import spans
from shared.worker.events import token_event
from shared.worker.ledger import Entry
from shared.worker.runtime import Worker

log = logging.getLogger(__name__)


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

    async def hand_on_in_hand(self) -> int:
        """Every request in the engine here goes to the prefill queue as its next attempt, with the tokens it has
        sampled (see the module); → how many. One still being admitted (its KV pulled) is handed on once it is
        in the engine (the caller asks again)."""
        moved = 0
        for entry in self.ledger:
            if not entry.phase.in_engine:
                continue
            key, fallback = entry.key, list(entry.job.output_token_ids)
            # outputs of the steps before this call reach the loop first: `tokens` are exactly those emitted
            tokens = await self.engine.call(lambda e, k=key, f=fallback: _take_out(e, k, f))
            if tokens is None or self.ledger.get(key) is not entry:
                continue  # it finished (or was cancelled) meanwhile
            await self._hand_on(entry, tokens)
            moved += 1
        return moved

    async def _hand_on(self, entry: Entry[Job], tokens: list[int]) -> None:
        job, worker_id = entry.job, self.settings.worker_id
        self.ledger.finish(entry.key)  # its message (if still held) is acked: the request goes on elsewhere
        self.emit(job.reply_subject, QueuedEvent(job.request_id, job.attempt, len(tokens), worker_id))
        moved = _next_attempt(job, tokens)
        subject = prefill_subject(self.model_name)
        await self.outbox.sent()  # every event of this attempt leaves before the next attempt can produce one
        error = None
        with tracing.use_span(entry.span):
            try:
                with tracing.producer_span(subject, job.request_id):
                    await self.conn.js.publish(subject, encode(moved), headers=tracing.carrier() or None)
            except Exception as exc:  # NATS away: the gateway's watchdog moves it once nothing comes
                error = f"handing it on failed: {exc}"
                log.warning("handing %s on to the prefill queue failed (%s)", entry.key, exc)
        metrics.ROLE_SWITCH_HANDED_ON.labels(*self.labels).inc()
        log.info("handed %s on to the prefill queue as attempt %d after %d tokens", entry.key, moved.attempt,
                 len(tokens))  # fmt: skip
        spans.end_once(entry.decode_span, error=error, finish_reason="handed_on")
        spans.end_once(entry.span, error=error)


def _take_out(engine: Engine, key: str, fallback: list[int]) -> list[int] | None:
    """On the engine thread: abort the request and return its output tokens so far (`fallback`, the job's own, for
    a choice not forked yet); None when the engine has it no more (it finished)."""
    req = engine.requests.get(key)
    tokens = list(req.output_token_ids) if req is not None else None
    if engine.abort(key) and tokens is None:
        tokens = fallback
    return tokens


def _next_attempt(job: PrefillJob | DecodeJob, tokens: list[int]) -> PrefillJob:
    """The job of the request's next attempt on the prefill queue, resuming after `tokens` (as the gateway's move
    does: a moved request always goes back to the prefill queue)."""
    reuse = job.kv_reuse if isinstance(job, DecodeJob) else job.decode_kv_reuse
    return PrefillJob(
        request_id=job.request_id,
        model=job.model,
        prompt_token_ids=job.prompt_token_ids,
        sampling=job.sampling,
        reply_subject=job.reply_subject,
        attempt=job.attempt + 1,
        created_at=job.created_at,
        output_token_ids=tokens,
        cache_salt=job.cache_salt,
        decode_kv_reuse=reuse,
    )
