"""Unit tests of shared/telemetry: what OTEL_* turns on, log lines with trace ids, carriers, the span file,
and the gateway's request observer against a real in-memory SDK provider."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.observe import RequestObserver
from services.gateway.prefill_path import PathChoice, Prediction
from shared.settings import PrefillPath
from shared.telemetry import metrics, tracing
from shared.telemetry.spanfile import JsonLinesSpanExporter, read_spans


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, []),  # compose passes an empty endpoint for "off"
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, []),
    ],
)
def test_exporters_wanted(environ, wanted):
    assert tracing.exporters_wanted(environ) == wanted


def test_unknown_exporter_or_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="zipkin"):
        tracing.setup_tracing("t", environ={"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/json"):
        tracing._otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.fixture
def spans():
    """A real SDK tracer whose finished spans are kept in memory (the module tracer is a proxy, so spans
    are created through this provider's tracer by patching tracing.tracer)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    original = tracing.tracer
    tracing.tracer = provider.get_tracer("test")
    yield exporter
    tracing.tracer = original
    provider.shutdown()


def test_carrier_round_trip_parents_a_remote_span(spans):
    parent = tracing.start_span("parent")
    headers = tracing.carrier(trace.set_span_in_context(parent))
    assert set(headers) == {"traceparent"} and headers["traceparent"].startswith("00-")
    child = tracing.consumer_span("pd.jobs.prefill.m", headers, "req-1", "w-1", delivered=2)
    child.end()
    parent.end()
    finished = {s.name: s for s in spans.get_finished_spans()}
    process = finished["process pd.jobs.prefill.m"]
    assert process.parent.span_id == parent.get_span_context().span_id
    assert process.attributes["messaging.nats.delivery_count"] == 2
    assert process.kind is trace.SpanKind.CONSUMER


def test_phase_spans_take_explicit_wall_times(spans):
    span = tracing.start_span("prefill m", start_s=1000.0)
    tracing.end_span(span, 1000.25, error="boom")
    (done,) = spans.get_finished_spans()
    assert (done.start_time, done.end_time) == (1000_000_000_000, 1000_250_000_000)
    assert done.status.status_code is trace.StatusCode.ERROR and done.status.description == "boom"


def test_log_lines_carry_the_trace_id(spans, caplog):
    tracing.install_log_trace_ids()
    log = logging.getLogger("test.trace")
    with caplog.at_level(logging.INFO, logger="test.trace"):
        log.info("outside")
        span = tracing.start_span("work")
        with tracing.use_span(span, end_on_exit=True):
            log.info("inside")
    outside, inside = caplog.records
    assert outside.trace == ""
    assert inside.trace == f" trace={span.get_span_context().trace_id:032x}"


def test_span_file_round_trip(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer", attributes={"pdserve.kv.bytes": 7}) as outer:
        with tracer.start_as_current_span("inner"):
            pass
    provider.shutdown()
    with open(path, "a") as f:
        f.write('{"trace_id": "cut sho')  # a process killed mid-line
    records = {r["name"]: r for r in read_spans(path)}
    assert set(records) == {"outer", "inner"}
    assert records["inner"]["parent_span_id"] == f"{outer.get_span_context().span_id:016x}"
    assert records["outer"]["attributes"] == {"pdserve.kv.bytes": 7}
    assert records["outer"]["end_ns"] >= records["inner"]["end_ns"]


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_request_observer_metrics_and_span(spans):
    model = "observer-unit"
    labels = {"model_name": model, "role": "gateway"}
    observer = RequestObserver(tracing.CHAT, model, "chatcmpl-1", {}, (1.0, 0.0), max_tokens=5, prompt_tokens=9)
    assert _sample("pdserve:num_requests_running", **labels) == 1
    local = Prediction("d", ttft_s=0.02, ready_s=0.02)
    observer.dispatched(PathChoice(PrefillPath.LOCAL, "sooner", Prediction("p", 0.019, 0.023), local, 0.012))
    observer.tokens(1)
    observer.tokens(3)  # three tokens in one update: one gap, then two zero gaps
    observer.end("length", completion_tokens=4)
    observer.end("length", completion_tokens=4)  # idempotent
    assert _sample("pdserve:num_requests_running", **labels) == 0
    assert _sample("pdserve:generation_tokens_total", **labels) == 4
    assert _sample("pdserve:prompt_tokens_total", **labels) == 9
    assert _sample("pdserve:time_to_first_token_seconds_count", path="local", **labels) == 1  # the request's path
    assert _sample("pdserve:inter_token_latency_seconds_count", path="local", **labels) == 3
    assert _sample("pdserve:request_success_total", finished_reason="length", path="local", **labels) == 1
    (span,) = spans.get_finished_spans()
    assert span.name == "chat observer-unit" and span.kind is trace.SpanKind.SERVER
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert span.attributes["gen_ai.server.time_to_first_token"] > 0
    assert span.attributes["pdserve.prefill_path"] == "local"  # and what it was predicted to take
    assert span.attributes["pdserve.prefill_path.reason"] == "sooner"
    assert span.attributes["pdserve.prefill_path.predicted_ttft_s"] == 0.02
    assert span.attributes["pdserve.prefill_path.remote_ready_s"] == 0.023
    assert span.attributes["pdserve.prefill_path.decode_slowdown_s"] == 0.012


def test_failed_request_counts_no_latency(spans):
    model = "observer-fail"
    labels = {"model_name": model, "role": "gateway"}
    observer = RequestObserver(tracing.CHAT, model, "chatcmpl-2", {}, (1.0, 0.0), max_tokens=5, prompt_tokens=3)
    observer.end("error", 0, "no worker", 503)
    assert _sample("pdserve:request_success_total", finished_reason="error", path="none", **labels) == 1
    assert _sample("pdserve:time_to_first_token_seconds_count", path="none", **labels) == 0
    assert _sample("pdserve:prompt_tokens_total", **labels) == 0
    (span,) = spans.get_finished_spans()
    assert span.status.status_code is trace.StatusCode.ERROR


def test_expert_load_counter():
    metrics.record_expert_load("expert-unit", "mixed", {0: [3, 0, 5], 2: [1, 1, 0]})
    metrics.record_expert_load("expert-unit", "mixed", {0: [1, 0, 0]})
    labels = {"model_name": "expert-unit", "role": "mixed"}
    assert _sample("pdserve:moe_expert_tokens_total", layer="0", expert="0", **labels) == 4
    assert _sample("pdserve:moe_expert_tokens_total", layer="0", expert="2", **labels) == 5
    assert _sample("pdserve:moe_expert_tokens_total", layer="2", expert="1", **labels) == 1
