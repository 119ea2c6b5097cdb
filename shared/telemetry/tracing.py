"""OpenTelemetry tracing for every service: setup, span and attribute names, and the carriers that take a
trace across NATS message headers and gRPC metadata (W3C `traceparent`, lowercase keys).

Setup follows the standard OTEL_* variables, with one deliberate difference: an exporter is created only
when something asks for one (an OTLP endpoint, OTEL_TRACES_EXPORTER=otlp|console, or a span file). With
none, no SDK provider is installed: the API's no-op tracer hands out non-recording spans and `inject`
writes no header, so instrumented code costs about a microsecond a span.

Spans sit at phase boundaries, never per token (one request):
    chat {model}                             gateway, SERVER; GenAI attributes, TTFT / TPOT / e2e
      publish pd.jobs.prefill.{model}        gateway, PRODUCER
        process pd.jobs.prefill.{model}      prefill worker, CONSUMER: fetched → handed on
          prefill {model}                    engine: first scheduled → first token; queue time
          publish pd.jobs.decode.{model}     PRODUCER
            process pd.jobs.decode.{model}   decode worker, CONSUMER: fetched → admitted
              pull_kv {model}                CLIENT: bytes, duration, outcome
                send_kv {model}              prefill worker, SERVER: export + send
              decode {model}                 admitted → finished; output tokens, TPOT
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from shared.telemetry.spanfile import JsonLinesSpanExporter

log = logging.getLogger(__name__)

tracer = trace.get_tracer("pdserve")  # a proxy: follows the provider setup_tracing installs later

# Span names are "{operation} {model}" (OpenTelemetry GenAI) or "{operation} {subject}" (messaging).
CHAT = "chat"
TEXT_COMPLETION = "text_completion"
PREFILL = "prefill"
DECODE = "decode"
PULL_KV = "pull_kv"
SEND_KV = "send_kv"
PUBLISH = "publish"
PROCESS = "process"

# GenAI semantic conventions
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TTFT = "gen_ai.server.time_to_first_token"  # seconds
GEN_AI_TPOT = "gen_ai.server.time_per_output_token"  # seconds
# Messaging semantic conventions
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_OPERATION = "messaging.operation.name"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_DELIVERY_COUNT = "messaging.nats.delivery_count"
# pdserve's phase timings and hand-off facts
REQUEST_ID = "pdserve.request_id"
ROLE = "pdserve.role"
WORKER_ID = "pdserve.worker_id"
QUEUE_TIME = "pdserve.queue_time_s"  # request created at the gateway → first scheduled by an engine
E2E_TIME = "pdserve.e2e_s"
KV_BYTES = "pdserve.kv.bytes"
KV_TOKENS = "pdserve.kv.tokens"
KV_DURATION = "pdserve.kv.duration_s"
KV_EXPORT_TIME = "pdserve.kv.export_s"
KV_OUTCOME = "pdserve.kv.outcome"  # pulled | recompute | local (prefilled on the decode worker by choice)
KV_PEER = "pdserve.kv.peer"
# the gateway's prefill path choice (services/gateway/prefill_path.py), on the request's span; seconds
PREFILL_PATH = "pdserve.prefill_path"  # remote | local
PREFILL_PATH_REASON = "pdserve.prefill_path.reason"  # the rule that decided
PREFILL_PATH_PREDICTED_TTFT = "pdserve.prefill_path.predicted_ttft_s"  # the chosen path's
PREFILL_PATH_REMOTE_TTFT = "pdserve.prefill_path.remote_ttft_s"
PREFILL_PATH_REMOTE_READY = "pdserve.prefill_path.remote_ready_s"  # remote TTFT + the KV hand-off
PREFILL_PATH_LOCAL_TTFT = "pdserve.prefill_path.local_ttft_s"
PREFILL_PATH_DECODE_SLOWDOWN = "pdserve.prefill_path.decode_slowdown_s"  # local: added to the decode batch's step
PREFILL_PATH_DECODE_TPOT = "pdserve.prefill_path.decode_tpot_s"  # local: the decode worker's mean TPOT with its share

_installed = None  # the SDK provider this process installed, if any


def exporters_wanted(environ: Mapping[str, str]) -> list[str]:
    """What OTEL_* asks to export to: [] (nothing set: no exporter), ["otlp"], ["console"], …"""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER")
    if named is not None:
        return [n for n in (x.strip().lower() for x in named.split(",")) if n and n != "none"]
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def setup_tracing(service: str, instance: str | None = None, trace_file: str | None = None, environ=None):
    """Install an SDK tracer provider exporting where OTEL_* (and `trace_file`) say; with nothing asked,
    install nothing and return None. `service` is the default service.name (OTEL_SERVICE_NAME wins).
    Returns the provider; its `shutdown()` flushes what is buffered (also run at interpreter exit)."""
    global _installed
    environ = os.environ if environ is None else environ
    wanted = exporters_wanted(environ)
    if not wanted and not trace_file:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {"service.instance.id": instance} if instance else {}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in wanted:
        if name == "otlp":
            exporter = _otlp_exporter(environ)
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported (use otlp, console or none)")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
    trace.set_tracer_provider(provider)
    _installed = provider
    log.info("tracing on: %s", ", ".join(wanted + ([f"file {trace_file}"] if trace_file else [])))
    return provider


def _otlp_exporter(environ: Mapping[str, str]):
    """OTLP over http/protobuf (the specification's default) or grpc; endpoint, headers, TLS and timeouts
    come from the OTEL_EXPORTER_OTLP_* variables, read by the exporter itself."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or "http/protobuf").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (use grpc or http/protobuf)")


def shutdown_tracing() -> None:
    """Flush and stop the provider setup_tracing installed (no-op when tracing is off)."""
    if _installed is not None:
        _installed.shutdown()


def tracing_enabled() -> bool:
    return _installed is not None


# ---- carriers --------------------------------------------------------------------------------------------


def carrier(ctx: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of `ctx` (default: the current context); {} when not tracing."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=ctx)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    """The remote parent carried in NATS headers / gRPC metadata (an empty context when none)."""
    return propagate.extract(dict(headers or {}))


def grpc_metadata(ctx: Context | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(carrier(ctx).items())


def current_trace_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return f"{span_context.trace_id:032x}" if span_context.is_valid else None


# ---- log lines carry the trace id --------------------------------------------------------------------------


def install_log_trace_ids() -> None:
    """Give every log record a `trace` attribute: " trace=<id>" inside a span, "" outside (use `%(trace)s`
    in the format). Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "adds_trace_ids", False):
        return
    logging.setLogRecordFactory(_TraceIdRecordFactory(previous))


class _TraceIdRecordFactory:
    """A log record factory: `previous`'s records, with `trace` set."""

    adds_trace_ids = True  # what install_log_trace_ids looks for, to wrap only once

    def __init__(self, previous: Callable[..., logging.LogRecord]) -> None:
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        trace_id = current_trace_id()
        record.trace = f" trace={trace_id}" if trace_id else ""
        return record


use_span = trace.use_span  # `with use_span(span, end_on_exit=...)`: make a span current in a block


def attach(ctx: Context):
    """Make `ctx` current until `detach(token)`."""
    return otel_context.attach(ctx)


def detach(token) -> None:
    otel_context.detach(token)


# ---- phase spans -------------------------------------------------------------------------------------------


def _ns(t: float) -> int:
    return int(t * 1e9)


def start_span(
    name: str,
    parent: Context | trace.Span | None = None,
    start_s: float | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> trace.Span:
    """A span under `parent` (a context, or a span of this process), started at wall time `start_s`
    (default now). Phase timestamps come from the engine thread, so spans take explicit times."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return tracer.start_span(
        name, context=ctx, kind=kind, attributes=attributes, start_time=None if start_s is None else _ns(start_s)
    )


def mark_error(span: trace.Span, error: str) -> None:
    span.set_status(trace.Status(trace.StatusCode.ERROR, error))


def end_span(span: trace.Span, end_s: float | None = None, error: str | None = None) -> None:
    """End `span` at wall time `end_s` (default now), as failed when `error` is given."""
    if error is not None:
        mark_error(span, error)
    span.end(end_time=None if end_s is None else _ns(end_s))


def _messaging(operation: str, subject: str, request_id: str, **extra: AttributeValue) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        MESSAGING_SYSTEM: "nats",
        MESSAGING_OPERATION: operation,
        MESSAGING_DESTINATION: subject,
    }
    return attributes | {REQUEST_ID: request_id} | extra


def consumer_span(subject: str, headers: Mapping[str, str] | None, request_id: str, worker_id: str, delivered: int):
    """`process <subject>`: a worker took a job; the parent is the publisher's span, from the headers."""
    attributes = _messaging(PROCESS, subject, request_id, **{MESSAGING_DELIVERY_COUNT: delivered, WORKER_ID: worker_id})
    return tracer.start_span(
        f"{PROCESS} {subject}", context=extract(headers), kind=trace.SpanKind.CONSUMER, attributes=attributes
    )


def producer_span(subject: str, request_id: str):
    """`publish <subject>` as the current span (a context manager); `carrier()` inside it gives the headers."""
    attributes = _messaging(PUBLISH, subject, request_id)
    return tracer.start_as_current_span(f"{PUBLISH} {subject}", kind=trace.SpanKind.PRODUCER, attributes=attributes)
