"""A request's spans and per-request metrics on a worker: `process <subject>` (a fetched job), `prefill`
(its prompt computed, with queue-time and prompt-token metrics) and `decode` (while it decodes here)."""

from __future__ import annotations

import time

import nats.errors
from nats.aio.msg import Msg
from opentelemetry.trace import Span

from shared.engine.engine import RequestOutput
from shared.messages import DecodeJob, PrefillJob
from shared.telemetry import metrics, tracing


def process_span(msg: Msg, request_id: str, worker_id: str) -> Span:
    """The `process <subject>` span of a job just fetched, child of its publisher's span."""
    try:
        delivered = msg.metadata.num_delivered
    except nats.errors.NotJSMessageError:  # a core-NATS message (tests, tools): first delivery
        delivered = 1
    return tracing.consumer_span(msg.subject, msg.headers, request_id, worker_id, delivered)


def record_prefill(job: PrefillJob | DecodeJob, out: RequestOutput, parent: Span, labels: tuple[str, str]) -> None:
    """A request's first output (its prompt is computed): the `prefill` span, from its first scheduling
    to now, and the queue-time and prompt-token metrics."""
    now = time.time()
    scheduled_at = out.scheduled_at or now
    attributes = {tracing.REQUEST_ID: job.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: out.num_prompt_tokens}
    if job.created_at:  # the gateway's clock: another machine's, so clamp a skew below zero
        queue_s = max(0.0, scheduled_at - job.created_at)
        attributes[tracing.QUEUE_TIME] = queue_s
        metrics.QUEUE_TIME.labels(*labels).observe(queue_s)
    metrics.PROMPT_TOKENS.labels(*labels).inc(out.num_prompt_tokens)
    span = tracing.start_span(f"{tracing.PREFILL} {labels[0]}", parent, scheduled_at, attributes=attributes)
    tracing.end_span(span, now)


def start_decode_span(
    job: PrefillJob | DecodeJob, parent: Span, model_name: str, worker_id: str, start_s: float | None = None
) -> Span:
    return tracing.start_span(
        f"{tracing.DECODE} {model_name}",
        parent,
        start_s,
        attributes={tracing.REQUEST_ID: job.request_id, tracing.WORKER_ID: worker_id},
    )


def end_decode_span(span: Span | None, out: RequestOutput) -> None:
    """The request finished here: its decode span ends with its output tokens and finish reason."""
    if span is None:
        return
    reason = out.finish_reason.value if out.finish_reason else "length"
    span.set_attribute(tracing.GEN_AI_USAGE_OUTPUT_TOKENS, out.num_output_tokens)
    span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH_REASONS, (reason,))
    tracing.end_span(span)


def end_once(span: Span | None, error: str | None = None, finish_reason: str | None = None) -> None:
    """End `span` unless it has ended already (an SDK span stops recording when it ends; a non-recording one
    is a no-op anyway), as failed when `error` is given."""
    if span is None or not span.is_recording():
        return
    if finish_reason is not None:
        span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH_REASONS, (finish_reason,))
    tracing.end_span(span, error=error)
