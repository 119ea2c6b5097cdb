"""`pdserve trace`: one request's timeline from a span file written by the real exporter (OpenTelemetry SDK
spans with known timestamps), for a P/D request, a mixed-worker request, a request whose decode worker left
no spans, and a trace that is no request at all."""

from __future__ import annotations

import argparse
import re

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.trace import timeline
from services.trace.timeline import (
    Phase,
    add_trace_command,
    list_requests,
    load_trace,
    phases,
    render_png,
    render_text,
    summarize,
)
from shared.telemetry.spanfile import JsonLinesSpanExporter, read_spans

T0 = 1_760_000_000_000_000_000  # ns
MS = 1_000_000
PD_START, MIXED_START, LOST_START, OTHER_START = T0, T0 + 1000 * MS, T0 + 2000 * MS, T0 + 3000 * MS
KV_BYTES = 2_000_000
EXPORTED = 9 + 5 + 6 + 1  # spans written: P/D request, mixed request, lost request (5 + orphan send_kv), other


class Service:
    """One fake process: its own provider (service.name), exporting to the shared span file, or nowhere
    (a process killed before it flushed)."""

    def __init__(self, name: str, path=None) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        if path is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        self.tracer = self.provider.get_tracer("pdserve")

    def span(self, name, kind, base, start_ms, end_ms, parent=None, attributes=None, error=None):
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(
            name, context=ctx, kind=kind, start_time=base + int(start_ms * MS), attributes=attributes or {}
        )
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span._test_end = base + int(end_ms * MS)  # ended by close(), children first like the real services
        return span


def close(*spans) -> None:
    for span in spans:
        span.end(end_time=span._test_end)


def root_attributes(request_id, ttft_s, tpot_s, out_tokens):
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny",
        "gen_ai.response.id": request_id,
        "pdserve.request_id": request_id,
        "gen_ai.server.time_to_first_token": ttft_s,
        "gen_ai.server.time_per_output_token": tpot_s,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": out_tokens,
        "gen_ai.response.finish_reasons": ("stop",),
    }


def write_pd_request(gateway, prefill, decode, base, request_id):
    """chat 0→200 ms; publish 1→2; process prefill 3→45 (prefill 5→40, publish decode 41→42); process decode
    43→60 (pull_kv 44→54 → send_kv 45→53); decode 60→198."""
    root = gateway.span("chat tiny", SpanKind.SERVER, base, 0, 200, None, root_attributes(request_id, 0.045, 0.01, 16))
    pub = gateway.span("publish pd.jobs.prefill.tiny", SpanKind.PRODUCER, base, 1, 2, root)
    proc = prefill.span("process pd.jobs.prefill.tiny", SpanKind.CONSUMER, base, 3, 45, pub)
    pre = prefill.span("prefill tiny", SpanKind.INTERNAL, base, 5, 40, proc, {"pdserve.queue_time_s": 0.005})
    pub_d = prefill.span("publish pd.jobs.decode.tiny", SpanKind.PRODUCER, base, 41, 42, proc)
    proc_d = decode.span("process pd.jobs.decode.tiny", SpanKind.CONSUMER, base, 43, 60, pub_d)
    pull_attrs = {"pdserve.kv.bytes": KV_BYTES, "pdserve.kv.duration_s": 0.010, "pdserve.kv.outcome": "pulled"}
    pull = decode.span("pull_kv tiny", SpanKind.CLIENT, base, 44, 54, proc_d, pull_attrs)
    send_attrs = {"pdserve.kv.bytes": KV_BYTES, "pdserve.kv.export_s": 0.002}
    send = prefill.span("send_kv tiny", SpanKind.SERVER, base, 45, 53, pull, send_attrs)
    dec = decode.span("decode tiny", SpanKind.INTERNAL, base, 60, 198, proc_d, {"gen_ai.usage.output_tokens": 16})
    return root, pub, proc, pre, pub_d, proc_d, pull, send, dec


@pytest.fixture(scope="module")
def span_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    gateway, prefill, decode = (Service(f"pdserve-{n}", path) for n in ("gateway", "prefill", "decode"))
    mixed = Service("pdserve-mixed", path)
    killed_decode = Service("pdserve-decode")  # exports nothing

    root, pub, proc, pre, pub_d, proc_d, pull, send, dec = write_pd_request(
        gateway, prefill, decode, PD_START, "chatcmpl-pd1"
    )
    close(pub, pre, pub_d, send, pull, proc, proc_d, dec, root)

    # mixed: text_completion 0→100; publish 1→2; process prefill 3→99 (prefill 4→20, decode 21→98)
    attrs = root_attributes("cmpl-mx1", 0.022, 0.005, 12) | {"gen_ai.operation.name": "text_completion"}
    m_root = gateway.span("text_completion tiny", SpanKind.SERVER, MIXED_START, 0, 100, None, attrs)
    m_pub = gateway.span("publish pd.jobs.prefill.tiny", SpanKind.PRODUCER, MIXED_START, 1, 2, m_root)
    m_proc = mixed.span("process pd.jobs.prefill.tiny", SpanKind.CONSUMER, MIXED_START, 3, 99, m_pub)
    m_pre = mixed.span("prefill tiny", SpanKind.INTERNAL, MIXED_START, 4, 20, m_proc)
    m_dec = mixed.span("decode tiny", SpanKind.INTERNAL, MIXED_START, 21, 98, m_proc)
    close(m_pub, m_pre, m_dec, m_proc, m_root)

    # the decode worker was killed: none of its spans reached the file; send_kv's parent (pull_kv) is missing
    l_root, l_pub, l_proc, l_pre, l_pub_d, _, _, l_send, _ = write_pd_request(
        gateway, prefill, killed_decode, LOST_START, "chatcmpl-lost"
    )
    l_root.set_status(Status(StatusCode.ERROR, "decode worker gone"))
    close(l_pub, l_pre, l_pub_d, l_send, l_proc, l_root)

    # a trace that is no request (later than every request)
    close(prefill.span("warmup tiny", SpanKind.INTERNAL, OTHER_START, 0, 5))

    with open(path, "a", encoding="utf-8") as f:
        f.write('{"trace_id": "0123456789abcdef0123456789abcdef", "span_id": "00')  # a write cut short
    return path


def by_name(spans):
    return {s["name"]: s for s in spans}


def trace_id_of(path, request_id):
    return next(s["trace_id"] for s in read_spans(path) if s["attributes"].get("gen_ai.response.id") == request_id)


# ---- selecting a trace -----------------------------------------------------------------------------------


def test_truncated_last_line_is_skipped(span_file):
    assert span_file.read_text().splitlines()[-1].startswith('{"trace_id": "0123')
    assert len(list(read_spans(span_file))) == EXPORTED
    assert sum(len(r.trace_id) == 32 for r in list_requests(span_file)) == 3


def test_load_by_request_id(span_file):
    spans = load_trace(span_file, request_id="chatcmpl-pd1")
    assert len(spans) == 9
    assert len({s["trace_id"] for s in spans}) == 1
    assert by_name(spans)["chat tiny"]["attributes"]["gen_ai.response.id"] == "chatcmpl-pd1"
    assert [s["start_ns"] for s in spans] == sorted(s["start_ns"] for s in spans)
    mixed = load_trace(span_file, request_id="cmpl-mx1")
    assert {s["service"] for s in mixed} == {"pdserve-gateway", "pdserve-mixed"}


def test_load_by_trace_id_and_prefix(span_file):
    tid = trace_id_of(span_file, "cmpl-mx1")
    assert {s["trace_id"] for s in load_trace(span_file, trace_id=tid)} == {tid}
    assert {s["trace_id"] for s in load_trace(span_file, trace_id=tid[:12].upper())} == {tid}
    with pytest.raises(ValueError, match="no trace"):
        load_trace(span_file, trace_id="f" * 32 if not tid.startswith("f") else "0" * 32)
    with pytest.raises(ValueError, match="matches"):
        load_trace(span_file, trace_id=" ")  # an empty prefix matches every trace


def test_default_is_the_latest_request(span_file):
    # the warmup trace is later but is no request: the latest request is the lost one
    spans = load_trace(span_file)
    assert timeline.request_id_of(spans) == "chatcmpl-lost"
    assert "warmup tiny" not in by_name(spans)


def test_errors_name_what_is_missing(span_file, tmp_path):
    with pytest.raises(ValueError, match="no request 'chatcmpl-nope'"):
        load_trace(span_file, request_id="chatcmpl-nope")
    with pytest.raises(FileNotFoundError, match="no span file"):
        load_trace(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"trace_id": "ab')
    with pytest.raises(ValueError, match="no spans"):
        load_trace(empty)
    only_warmup = tmp_path / "warmup.jsonl"
    close(Service("pdserve-prefill", only_warmup).span("warmup tiny", SpanKind.INTERNAL, T0, 0, 1))
    with pytest.raises(ValueError, match="no request's root span"):
        load_trace(only_warmup)
    assert len(load_trace(only_warmup, trace_id=next(read_spans(only_warmup))["trace_id"][:8])) == 1


def test_list_requests(span_file):
    rows = list_requests(span_file)
    assert [r.request_id for r in rows] == ["chatcmpl-pd1", "cmpl-mx1", "chatcmpl-lost"]
    pd = rows[0]
    assert pd.trace_id == trace_id_of(span_file, "chatcmpl-pd1")
    assert (pd.start_ns, pd.duration_ms, pd.ttft_ms, pd.output_tokens) == (PD_START, 200.0, 45.0, 16)
    assert rows[1].name == "text_completion tiny" and rows[2].status == "ERROR"
    text = timeline.render_list(rows)
    assert "chatcmpl-pd1" in text and "cmpl-mx1" in text and "warmup" not in text


# ---- phases and summary ----------------------------------------------------------------------------------


def test_phases_of_a_pd_request(span_file):
    got = phases(load_trace(span_file, request_id="chatcmpl-pd1"))
    assert [p.name for p in got] == ["queue", "prefill", "hand-off", "kv transfer", "decode"]
    ms = {p.name: (p.start_ns - PD_START) / MS for p in got}
    assert ms == {"queue": 1, "prefill": 5, "hand-off": 40, "kv transfer": 44, "decode": 60}
    assert [p.duration_ms for p in got] == [4.0, 35.0, 4.0, 10.0, 138.0]
    assert got[0] == Phase("queue", PD_START + 1 * MS, PD_START + 5 * MS)


def test_phases_of_a_mixed_request(span_file):
    got = phases(load_trace(span_file, request_id="cmpl-mx1"))
    assert [(p.name, p.duration_ms) for p in got] == [("queue", 3.0), ("prefill", 16.0), ("decode", 77.0)]


def test_summary(span_file):
    s = summarize(load_trace(span_file, request_id="chatcmpl-pd1"))
    assert s.request_id == "chatcmpl-pd1"
    assert (s.ttft_s, s.e2e_s, s.queue_s, s.tpot_s) == (0.045, 0.2, 0.005, 0.01)
    assert (s.input_tokens, s.output_tokens, s.finish_reasons) == (7, 16, ("stop",))
    assert (s.kv_bytes, s.kv_transfer_s, s.kv_outcome) == (KV_BYTES, 0.010, "pulled")
    assert s.kv_gbps == pytest.approx(0.2)
    m = summarize(load_trace(span_file, request_id="cmpl-mx1"))
    assert m.kv_bytes is None and m.kv_gbps is None and m.queue_s == pytest.approx(0.003)


def test_ttft_from_the_first_token_event(span_file):
    spans = load_trace(span_file, request_id="cmpl-mx1")
    root = by_name(spans)["text_completion tiny"]
    attributes = {k: v for k, v in root["attributes"].items() if k != "gen_ai.server.time_to_first_token"}
    event = {"name": "first_token", "time_ns": MIXED_START + 25 * MS, "attributes": {}}
    spans = [s for s in spans if s is not root] + [{**root, "attributes": attributes, "events": [event]}]
    s = summarize(spans)
    assert s.ttft_s == pytest.approx(0.025) and not s.ttft_estimated
    s = summarize([{**sp, "events": []} if sp["name"] == root["name"] else sp for sp in spans])
    assert s.ttft_s == pytest.approx(0.020) and s.ttft_estimated  # prefill end − request start


# ---- text ------------------------------------------------------------------------------------------------


def rows_of(text):
    """span name → its table line."""
    lines = text.split("\n\n")[1].splitlines()[1:]
    return {line.strip().split("  ")[0].removeprefix("? ").removesuffix(" !"): line for line in lines} | {"": lines}


def indent(line):
    return len(line) - len(line.lstrip(" "))


def test_render_text_tree_and_bars(span_file):
    text = render_text(load_trace(span_file, request_id="chatcmpl-pd1"))
    spans = load_trace(span_file, request_id="chatcmpl-pd1")
    for span in spans:
        assert span["name"] in text
    assert text.startswith("request chatcmpl-pd1  trace ")
    rows = rows_of(text)
    depth = {name: indent(line) // 2 for name, line in rows.items() if name}
    assert depth == {
        "chat tiny": 0,
        "publish pd.jobs.prefill.tiny": 1,
        "process pd.jobs.prefill.tiny": 2,
        "prefill tiny": 3,
        "publish pd.jobs.decode.tiny": 3,
        "process pd.jobs.decode.tiny": 4,
        "pull_kv tiny": 5,
        "send_kv tiny": 6,
        "decode tiny": 5,
    }
    assert [line.strip().split("  ")[0] for line in rows[""]][:4] == [
        "chat tiny",
        "publish pd.jobs.prefill.tiny",
        "process pd.jobs.prefill.tiny",
        "prefill tiny",
    ]
    # service, offset and duration columns, and a 60-column bar placed where the span sits in 200 ms
    assert re.search(r"send_kv tiny\s+prefill\s+45\.0\s+8\.00\s+\[", rows["send_kv tiny"])
    assert re.search(r"decode tiny\s+decode\s+60\.0\s+138\.0\s+\[", rows["decode tiny"])
    bar = rows["decode tiny"].split("[", 1)[1].rstrip("]")
    assert len(bar) == 60 and bar.index("#") == 18 and bar.rindex("#") == 59
    assert rows["chat tiny"].endswith("[" + "#" * 60 + "]")


def test_render_text_phase_summary(span_file):
    text = render_text(load_trace(span_file, request_id="chatcmpl-pd1"))
    phase_lines = {line.split("  ")[0].strip(): line for line in text.split("\n\n")[2].splitlines()[1:]}
    assert list(phase_lines) == ["queue", "prefill", "hand-off", "kv transfer", "decode"]
    expected = {"queue": ("4.00", "2.0"), "prefill": ("35.0", "17.5"), "hand-off": ("4.00", "2.0")}
    expected |= {"kv transfer": ("10.0", "5.0"), "decode": ("138.0", "69.0")}
    for name, (ms, pct) in expected.items():
        assert re.search(rf"^{name}\s+{re.escape(ms)}\s+{re.escape(pct)}%\s+\[", phase_lines[name]), phase_lines[name]
    assert "TTFT 45.0 ms  TPOT 10.00 ms  e2e 200.0 ms  queue 5.00 ms" in text
    assert "tokens 7 in / 16 out  finish stop" in text
    assert "kv 2,000,000 bytes in 10.0 ms = 0.20 GB/s (pulled)" in text
    assert "not in the file" not in text and "?" not in text


def test_render_text_mixed(span_file):
    text = render_text(load_trace(span_file, request_id="cmpl-mx1"))
    rows = rows_of(text)
    assert indent(rows["prefill tiny"]) == indent(rows["decode tiny"]) == 6  # both under process prefill
    assert "mixed" in rows["decode tiny"]
    assert "hand-off" not in text and "kv transfer" not in text and "GB/s" not in text
    assert re.search(r"^decode\s+77\.0\s+77\.0%", text, re.M)


def test_render_text_with_missing_decode_spans(span_file):
    spans = load_trace(span_file, request_id="chatcmpl-lost")
    assert {s["service"] for s in spans} == {"pdserve-gateway", "pdserve-prefill"}
    assert [p.name for p in phases(spans)] == ["queue", "prefill"]
    text = render_text(spans)
    rows = rows_of(text)
    assert rows["send_kv tiny"].startswith("? send_kv tiny")  # its parent (pull_kv) never reached the file
    assert rows["chat tiny"].startswith("chat tiny !")
    assert "! chat tiny: decode worker gone" in text
    assert "not in the file: process decode, pull_kv, decode" in text
    assert "kv 2,000,000 bytes (" not in text and "kv 2,000,000 bytes" in text


def test_render_text_without_a_root_span(span_file):
    spans = [s for s in load_trace(span_file, request_id="chatcmpl-pd1") if not s["name"].startswith("chat")]
    text = render_text(spans)
    assert "span extent 197.0 ms" in text
    assert rows_of(text)["publish pd.jobs.prefill.tiny"].startswith("? publish")
    assert "TTFT ~39.0 ms" in text  # estimated: prefill end − the earliest span
    assert "not in the file: chat / text_completion (the gateway's root)" in text


# ---- png and the command ---------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_render_png(span_file, tmp_path):
    out = render_png(load_trace(span_file, request_id="chatcmpl-pd1"), tmp_path / "sub" / "pd.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    lost = render_png(load_trace(span_file, request_id="chatcmpl-lost"), tmp_path / "lost.png")
    assert lost.read_bytes().startswith(PNG_MAGIC)


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_trace_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_cli_prints_the_timeline_and_writes_png(span_file, tmp_path, capsys):
    png = tmp_path / "t.png"
    rc, out, err = run_cli(["trace", str(span_file), "--request-id", "chatcmpl-pd1", "--png", str(png)], capsys)
    assert rc == 0 and err == ""
    assert out.startswith("request chatcmpl-pd1") and "pull_kv tiny" in out and f"wrote {png}" in out
    assert png.read_bytes().startswith(PNG_MAGIC)
    tid = trace_id_of(span_file, "cmpl-mx1")
    rc, out, _ = run_cli(["trace", str(span_file), "--trace-id", tid[:10]], capsys)
    assert rc == 0 and out.startswith("request cmpl-mx1")
    rc, out, _ = run_cli(["trace", str(span_file)], capsys)
    assert rc == 0 and out.startswith("request chatcmpl-lost")
    rc, out, _ = run_cli(["trace", str(span_file), "--list"], capsys)
    assert rc == 0 and len(out.splitlines()) == 4 and "cmpl-mx1" in out


def test_cli_errors(span_file, tmp_path, capsys):
    rc, out, err = run_cli(["trace", str(span_file), "--request-id", "chatcmpl-nope"], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("pdserve: error: no request 'chatcmpl-nope'")
    rc, _, err = run_cli(["trace", str(tmp_path / "absent.jsonl")], capsys)
    assert rc == 2 and err.startswith("pdserve: error: no span file")
    with pytest.raises(SystemExit):  # one or the other
        run_cli(["trace", str(span_file), "--request-id", "a", "--trace-id", "b"], capsys)


def test_a_request_on_the_local_prefill_path_shows_its_path_and_predicted_ttft(tmp_path):
    """chat 0→100 ms (the local path, 18 ms TTFT predicted); publish decode 1→2; process decode 3→99 on the decode
    worker (prefill 4→20, decode 21→98): no hand-off, nothing missing."""
    path = tmp_path / "spans.jsonl"
    gateway, decode = Service("pdserve-gateway", path), Service("pdserve-decode", path)
    path_attrs = {"pdserve.prefill_path": "local", "pdserve.prefill_path.reason": "sooner",
                  "pdserve.prefill_path.predicted_ttft_s": 0.018}  # fmt: skip
    attrs = root_attributes("chatcmpl-local", 0.021, 0.005, 12) | path_attrs
    root = gateway.span("chat tiny", SpanKind.SERVER, T0, 0, 100, None, attrs)
    pub = gateway.span("publish pd.jobs.decode.tiny", SpanKind.PRODUCER, T0, 1, 2, root)
    proc = decode.span("process pd.jobs.decode.tiny", SpanKind.CONSUMER, T0, 3, 99, pub)
    pre = decode.span("prefill tiny", SpanKind.INTERNAL, T0, 4, 20, proc, {"pdserve.queue_time_s": 0.003})
    dec = decode.span("decode tiny", SpanKind.INTERNAL, T0, 21, 98, proc)
    close(pub, pre, dec, proc, root)
    spans = load_trace(path, request_id="chatcmpl-local")
    summary = summarize(spans)
    assert (summary.prefill_path, summary.prefill_path_reason) == ("local", "sooner")
    assert summary.predicted_ttft_s == pytest.approx(0.018)
    assert [p.name for p in phases(spans)] == ["queue", "prefill", "decode"]  # queued on the decode queue
    assert timeline.missing_operations(spans) == []
    text = render_text(spans)
    assert "prefill path local (sooner): TTFT predicted 18.0 ms, actual 21.0 ms" in text
    assert "not in the file" not in text
