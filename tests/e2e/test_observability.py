"""Traces and metrics of a running stack (real nats-server, redis-server, gateway and P/D workers), received
the way operators receive them: spans over OTLP/HTTP by a real receiver (and into a span file), metrics
scraped from every /metrics endpoint and parsed with prometheus_client's parser."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.local.infra import free_port
from services.local.stack import StackSpec
from services.trace import timeline
from shared.telemetry.spanfile import read_spans
from tests.e2e_support import start_stack
from tests.otlp_receiver import OtlpReceiver

MAX_TOKENS = 6
PUBLISH_PREFILL = "publish pd.jobs.prefill.demo"
PROCESS_PREFILL = "process pd.jobs.prefill.demo"
PUBLISH_DECODE = "publish pd.jobs.decode.demo"
PROCESS_DECODE = "process pd.jobs.decode.demo"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def span_file(tmp_path_factory):
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def stack(model_dir, receiver, span_file):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the receiver quickly
    }
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, env=env, trace_file=str(span_file))
    stack = start_stack(spec)
    yield stack
    stack.stop()


def _chat(url: str, content: str, headers: dict | None = None, stream: bool = False, **extra) -> dict:
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream} | extra  # fmt: skip
    with httpx.Client(timeout=120) as client:
        if not stream:
            resp = client.post(f"{url}/v1/chat/completions", json=body, headers=headers or {})
            assert resp.status_code == 200, resp.text
            return resp.json()
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [e[len("data: ") :] for e in resp.read().decode().split("\n\n") if e.strip()]
        chunks = [json.loads(e) for e in events[:-1]]
        return {"id": chunks[0]["id"], "usage": chunks[-1]["usage"]}


def _root_of(spans: list[dict], request_id: str) -> dict | None:
    return next((s for s in spans if s["attributes"].get("gen_ai.response.id") == request_id), None)


def _whole_trace(receiver: OtlpReceiver, request_id: str) -> list[dict]:
    """The request's spans, once all nine have arrived (each service flushes on its own schedule)."""

    def complete(r: OtlpReceiver):
        root = _root_of(r.all_spans(), request_id)
        spans = r.trace(root["trace_id"]) if root else []
        return spans if len(spans) >= 9 else None

    return receiver.wait_for(complete) or []


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_one_trace_across_gateway_prefill_and_decode(stack, receiver):
    answer = _chat(stack.url, "Trace this request across every service")
    spans = _whole_trace(receiver, answer["id"])
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(
        [
            "chat demo",
            PUBLISH_PREFILL,
            PROCESS_PREFILL,
            "prefill demo",
            PUBLISH_DECODE,
            PROCESS_DECODE,
            "pull_kv demo",
            "send_kv demo",
            "decode demo",
        ]  # fmt: skip
    ), [s["name"] for s in spans]
    assert len({s["trace_id"] for s in spans}) == 1

    # parented as the request flowed: gateway → NATS → prefill → NATS → decode → gRPC → prefill
    parent_of = {name: by_name[name]["parent_span_id"] for name in by_name}
    span_id = {name: by_name[name]["span_id"] for name in by_name}
    assert parent_of["chat demo"] is None
    assert parent_of[PUBLISH_PREFILL] == span_id["chat demo"]
    assert parent_of[PROCESS_PREFILL] == span_id[PUBLISH_PREFILL]
    assert parent_of["prefill demo"] == span_id[PROCESS_PREFILL]
    assert parent_of[PUBLISH_DECODE] == span_id[PROCESS_PREFILL]
    assert parent_of[PROCESS_DECODE] == span_id[PUBLISH_DECODE]
    assert parent_of["pull_kv demo"] == span_id[PROCESS_DECODE]
    assert parent_of["send_kv demo"] == span_id["pull_kv demo"]
    assert parent_of["decode demo"] == span_id[PROCESS_DECODE]

    services = {name: s["service"] for name, s in by_name.items()}
    assert services["chat demo"] == services[PUBLISH_PREFILL] == "pdserve-gateway"
    assert services[PROCESS_PREFILL] == services["prefill demo"] == services["send_kv demo"] == "pdserve-prefill"
    assert services[PROCESS_DECODE] == services["pull_kv demo"] == services["decode demo"] == "pdserve-decode"
    kinds = {name: s["kind"] for name, s in by_name.items()}
    assert (kinds["chat demo"], kinds[PUBLISH_PREFILL], kinds[PROCESS_PREFILL]) == ("SERVER", "PRODUCER", "CONSUMER")
    assert (kinds["pull_kv demo"], kinds["send_kv demo"]) == ("CLIENT", "SERVER")
    assert by_name[PROCESS_PREFILL]["attributes"]["messaging.system"] == "nats"

    root = by_name["chat demo"]["attributes"]
    usage = answer["usage"]
    assert root["gen_ai.request.model"] == "demo"
    assert root["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert root["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
    assert root["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 < root["gen_ai.server.time_to_first_token"] < root["pdserve.e2e_s"]
    assert root["gen_ai.server.time_per_output_token"] > 0

    # the transfer, seen from both sides: the same bytes; durations inside their spans
    pull, send = by_name["pull_kv demo"], by_name["send_kv demo"]
    assert pull["attributes"]["pdserve.kv.bytes"] == send["attributes"]["pdserve.kv.bytes"] > 0
    assert pull["attributes"]["pdserve.kv.tokens"] == usage["prompt_tokens"]
    assert pull["attributes"]["pdserve.kv.outcome"] == "pulled"
    for span in (pull, send):
        assert 0 < span["attributes"]["pdserve.kv.duration_s"] <= (span["end_ns"] - span["start_ns"]) / 1e9 + 1e-3
    assert by_name["prefill demo"]["attributes"]["pdserve.queue_time_s"] >= 0
    assert by_name["decode demo"]["attributes"]["gen_ai.usage.output_tokens"] == MAX_TOKENS
    # phases in order: the prefill ends before the pull starts; decoding ends within the request
    assert by_name["prefill demo"]["end_ns"] <= pull["start_ns"]
    assert by_name["decode demo"]["end_ns"] <= by_name["chat demo"]["end_ns"]


def test_a_client_traceparent_is_continued(stack, receiver):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    answer = _chat(stack.url, "continue my trace", headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    spans = _whole_trace(receiver, answer["id"])
    root = _root_of(spans, answer["id"])
    assert root["trace_id"] == trace_id and root["parent_span_id"] == parent
    assert {s["trace_id"] for s in spans} == {trace_id}


def test_span_file_and_timeline(stack, receiver, span_file, capsys):
    answer = _chat(stack.url, "write me to the span file", stream=True)
    otlp = _whole_trace(receiver, answer["id"])
    trace_id = otlp[0]["trace_id"]

    def in_file():
        spans = [s for s in read_spans(span_file) if s["trace_id"] == trace_id]
        return spans if len(spans) >= len(otlp) else None

    deadline = time.monotonic() + 10
    while not in_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    file_spans = in_file()
    assert file_spans, "the span file never got the request's spans"
    assert {s["span_id"] for s in file_spans} == {s["span_id"] for s in otlp}  # the same spans, both exporters

    text = timeline.render_text(timeline.load_trace(span_file, request_id=answer["id"]))
    for phase in ("queue", "prefill", "kv transfer", "decode"):
        assert phase in text
    assert answer["id"] in text


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of one /metrics endpoint, by (name, sorted labels); parsed by prometheus_client."""
    text = httpx.get(url, timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _total(samples, name: str, **labels) -> float:
    """Sum of `name` over samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _expert_tokens_by_layer(samples, role: str) -> dict[str, float]:
    layers: dict[str, float] = defaultdict(float)
    for (name, labels), v in samples.items():
        d = dict(labels)
        if name == "pdserve:moe_expert_tokens_total" and d["role"] == role:
            layers[d["layer"]] += v
    return dict(layers)


def _scrape_all(stack) -> dict[str, dict]:
    prefill_url, decode_url = stack.metrics_urls()
    return {"gateway": _scrape(f"{stack.url}/metrics"), "prefill": _scrape(prefill_url), "decode": _scrape(decode_url)}


def _settled(stack) -> dict[str, dict]:
    """Scrapes once worker-side counters stop moving (expert load and gauges refresh each heartbeat, 1 s)."""
    last = _scrape_all(stack)
    for _ in range(20):
        time.sleep(1.2)
        now = _scrape_all(stack)
        keys = ("pdserve:moe_expert_tokens_total", "pdserve:generation_tokens_total", "pdserve:kv_cache_usage_perc")
        if all(_total(now[r], k) == _total(last[r], k) for r in now for k in keys):
            return now
        last = now
    return last


def test_metrics_count_what_was_served(stack, model_dir):
    top_k = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    before = _settled(stack)
    answers = [_chat(stack.url, f"count me {i} " * (i + 1), stream=i % 2 == 1) for i in range(4)]
    after = _settled(stack)
    n = len(answers)
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    assert completion == n * MAX_TOKENS

    def delta(endpoint: str, name: str, **labels) -> float:
        return _total(after[endpoint], name, **labels) - _total(before[endpoint], name, **labels)

    # the gateway counts what clients got
    assert delta("gateway", "pdserve:generation_tokens_total", role="gateway", model_name="demo") == completion
    assert delta("gateway", "pdserve:prompt_tokens_total", role="gateway") == prompt
    assert delta("gateway", "pdserve:request_success_total", finished_reason="length") == n
    assert delta("gateway", "pdserve:time_to_first_token_seconds_count") == n
    assert delta("gateway", "pdserve:e2e_request_latency_seconds_count") == n
    assert delta("gateway", "pdserve:request_time_per_output_token_seconds_count") == n
    assert delta("gateway", "pdserve:inter_token_latency_seconds_count") == completion - n
    assert delta("gateway", "pdserve:time_to_first_token_seconds_sum") > 0
    assert _total(after["gateway"], "pdserve:num_requests_running") == 0

    # the workers count what they computed: prefill samples each first token, decode the rest
    assert delta("prefill", "pdserve:prompt_tokens_total", role="prefill") == prompt
    assert delta("prefill", "pdserve:generation_tokens_total", role="prefill") == n
    assert delta("decode", "pdserve:generation_tokens_total", role="decode") == completion - n
    assert delta("decode", "pdserve:prompt_tokens_total") == 0  # every KV was pulled, none recomputed
    assert delta("prefill", "pdserve:request_queue_time_seconds_count") == n
    for role in ("prefill", "decode"):
        assert delta(role, "pdserve:kv_transfer_seconds_count", role=role) == n
        assert _total(after[role], "pdserve:kv_cache_usage_perc", role=role) == 0  # all blocks free again
        assert ("pdserve:num_requests_waiting", (("model_name", "demo"), ("role", role))) in after[role]
    sent = delta("prefill", "pdserve:kv_transfer_bytes_total")
    assert sent == delta("decode", "pdserve:kv_transfer_bytes_total") > 0
    assert delta("decode", "pdserve:kv_transfer_failures_total") == 0
    # one host: each pull asked over the prefill worker's Unix socket (local_stream.py), its blocks borrowed from the
    # prefill pool in place and copied into the decode pool (borrow.py); all released (the usage above is 0)
    assert delta("decode", "pdserve:kv_local_pulls_total", role="decode") == n
    assert delta("decode", "pdserve:kv_borrowed_pulls_total", role="decode") == n

    # MoE expert load: every computed token is routed to top_k experts in each sparse layer
    for role, computed in (("prefill", prompt), ("decode", completion - n)):
        load_before = _expert_tokens_by_layer(before[role], role)
        load_after = _expert_tokens_by_layer(after[role], role)
        assert load_after, f"no expert load from the {role} worker"
        for layer, total in load_after.items():
            assert total - load_before.get(layer, 0) == computed * top_k, (role, layer)


def test_tracing_off_creates_no_exporter():
    """With no OTEL_* asking for one, setup installs nothing and spans are non-recording (in a clean process,
    so the global provider of this one does not matter)."""
    code = (
        "from opentelemetry import trace\n"
        "from shared.telemetry import tracing\n"
        "assert tracing.setup_tracing('pdserve-test', environ={}) is None\n"
        "assert not tracing.tracing_enabled()\n"
        "assert type(trace.get_tracer_provider()).__name__ == 'ProxyTracerProvider'\n"
        "span = tracing.start_span('x')\n"
        "assert not span.is_recording()\n"
        "with tracing.use_span(span):\n"
        "    assert tracing.carrier() == {}\n"
        "print('ok')\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # no OTEL_* inherited
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == ""
