"""One request's timeline from a span file, without Jaeger: `pdserve trace SPANS_FILE`.

Reads the JSON-lines span file that `pdserve up --trace-file F` has every service append to (format in
`shared.telemetry.spanfile`; the span tree of a request in `shared.telemetry.tracing`), picks one trace
(by request id, by trace id or its prefix, or the most recent request), and prints it: one row per span in
the parent tree, indented by depth, with its service, start offset and duration in ms and a bar showing
where in the request it sits; then the phases (queue → prefill → hand-off → kv transfer → decode) with
their share of the end-to-end time, and the facts that matter (TTFT, TPOT, tokens, KV bytes and GB/s).
`--png OUT.png` also draws it as a Gantt chart; `--list` lists the requests in the file.

    $ pdserve trace spans.jsonl --request-id chatcmpl-pd1 --width 40
    request chatcmpl-pd1  trace 2caf95c2b6f2cff0ed502286b1776ac4  chat tiny  e2e 200.0 ms

    span                                 service   start ms    dur ms  0 ms                              200.0 ms
    chat tiny                            gateway      0.000     200.0  [########################################]
      publish pd.jobs.prefill.tiny       gateway       1.00      1.00  [#                                       ]
        process pd.jobs.prefill.tiny     prefill       3.00      42.0  [#########                               ]
          prefill tiny                   prefill       5.00      35.0  [ #######                                ]
          publish pd.jobs.decode.tiny    prefill       41.0      1.00  [        #                               ]
            process pd.jobs.decode.tiny  decode        43.0      17.0  [        ####                            ]
              pull_kv tiny               decode        44.0      10.0  [        ###                             ]
                send_kv tiny             prefill       45.0      8.00  [         ##                             ]
              decode tiny                decode        60.0     138.0  [            ############################]

    phase                ms   % e2e
    queue              4.00    2.0%  [#                                       ]
    prefill            35.0   17.5%  [ #######                                ]
    hand-off           4.00    2.0%  [        #                               ]
    kv transfer        10.0    5.0%  [        ###                             ]
    decode            138.0   69.0%  [            ############################]

    TTFT 45.0 ms  TPOT 10.00 ms  e2e 200.0 ms  queue 5.00 ms
    tokens 7 in / 16 out  finish stop
    kv 2,000,000 bytes in 10.0 ms = 0.20 GB/s (pulled)

The queue phase is measured between spans (prefill publish start → prefill start); the `queue` fact is the
engine's pdserve.queue_time_s (request created at the gateway → first scheduled) when a span carries it.
Spans may be missing (a batch not yet flushed, a process killed): what is there is shown; a span whose
parent is not in the file is shown at top level, marked `?`; expected spans that are absent are named.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from shared.telemetry.spanfile import read_spans
from shared.telemetry.tracing import (
    CHAT,
    DECODE,
    E2E_TIME,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_TPOT,
    GEN_AI_TTFT,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    KV_BYTES,
    KV_DURATION,
    KV_OUTCOME,
    PREFILL,
    PREFILL_PATH,
    PREFILL_PATH_PREDICTED_TTFT,
    PREFILL_PATH_REASON,
    PROCESS,
    PUBLISH,
    PULL_KV,
    QUEUE_TIME,
    REQUEST_ID,
    SEND_KV,
    TEXT_COMPLETION,
)

BAR_WIDTH = 60
ROOT_OPERATIONS = (CHAT, TEXT_COMPLETION)
PREFILL_SUBJECT = "pd.jobs.prefill."
DECODE_SUBJECT = "pd.jobs.decode."
SERVICE_PREFIX = "pdserve-"
PHASE_NAMES = ("queue", "prefill", "hand-off", "kv transfer", "decode")


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def duration_ms(self) -> float:
        return self.duration_ns / 1e6


@dataclass(frozen=True)
class Summary:
    """The facts of one request; None where the spans that carry them are missing."""

    request_id: str | None
    trace_id: str | None
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None
    tpot_s: float | None
    input_tokens: int | None
    output_tokens: int | None
    finish_reasons: tuple[str, ...]
    kv_bytes: int | None
    kv_transfer_s: float | None
    kv_outcome: str | None
    ttft_estimated: bool = False  # no TTFT attribute: prefill end − request start
    # the gateway's prefill path choice (remote | local), the rule that decided, and the TTFT it predicted
    prefill_path: str | None = None
    prefill_path_reason: str | None = None
    predicted_ttft_s: float | None = None

    @property
    def kv_gbps(self) -> float | None:
        if not self.kv_bytes or not self.kv_transfer_s:
            return None
        return self.kv_bytes / self.kv_transfer_s / 1e9


@dataclass(frozen=True)
class RequestRow:
    """One request (a trace with a gateway root span) in a span file."""

    request_id: str | None
    trace_id: str
    name: str
    start_ns: int
    duration_ms: float
    ttft_ms: float | None
    output_tokens: int | None
    status: str


# ---- reading ---------------------------------------------------------------------------------------------


def _read_traces(path: str | os.PathLike) -> dict[str, list[dict]]:
    """trace id → its spans (sorted by start), from the span file; a span written twice is kept once."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no span file {p} (write one with: pdserve up --trace-file {p})")
    if p.is_dir():
        raise ValueError(f"{p} is a directory, not a span file")
    traces: dict[str, list[dict]] = {}
    seen: set[tuple[str, object]] = set()  # (trace id, span id as written, maybe missing)
    for record in read_spans(p):
        trace_id, span_id = record.get("trace_id"), record.get("span_id")
        if not isinstance(trace_id, str) or not isinstance(record.get("start_ns"), int):
            continue
        if (trace_id, span_id) in seen:
            continue
        seen.add((trace_id, span_id))
        if not isinstance(record.get("end_ns"), int):
            record = {**record, "end_ns": record["start_ns"]}
        record.setdefault("attributes", {})
        if not isinstance(record["attributes"], dict):
            record["attributes"] = {}
        traces.setdefault(trace_id, []).append(record)
    for spans in traces.values():
        spans.sort(key=lambda s: (s["start_ns"], -s["end_ns"]))
    return traces


def load_trace(path: str | os.PathLike, request_id: str | None = None, trace_id: str | None = None) -> list[dict]:
    """The spans of one trace in the span file at `path`, sorted by start: the trace whose id starts with
    `trace_id`, or the one with a span whose gen_ai.response.id or pdserve.request_id is `request_id`
    (both given: both must hold), or with neither the most recent request (trace with a gateway root).
    Raises FileNotFoundError / ValueError saying what is missing."""
    traces = _read_traces(path)
    if not traces:
        raise ValueError(f"{path} holds no spans yet (services flush spans in batches, every few seconds)")
    candidates = traces
    if trace_id:
        prefix = trace_id.strip().lower()
        candidates = {t: s for t, s in candidates.items() if t.startswith(prefix)}
        if not candidates:
            raise ValueError(f"no trace {trace_id!r} in {path}")
        if len(candidates) > 1 and not request_id:
            raise ValueError(f"trace id prefix {trace_id!r} matches {len(candidates)} traces in {path}: give more")
    if request_id:
        candidates = {t: s for t, s in candidates.items() if _has_request_id(s, request_id)}
        if not candidates:
            where = f"trace {trace_id!r} of {path}" if trace_id else str(path)
            raise ValueError(f"no request {request_id!r} in {where} (pdserve trace {path} --list lists them)")
    if not trace_id and not request_id:
        candidates = {t: s for t, s in candidates.items() if gateway_root(s) is not None}
        if not candidates:
            raise ValueError(
                f"{path} holds {len(traces)} trace(s) but no request's root span ({' / '.join(ROOT_OPERATIONS)});"
                " pick one with --trace-id"
            )
    return max(candidates.values(), key=lambda spans: _start_of(spans))


def _has_request_id(spans: Iterable[dict], request_id: str) -> bool:
    for span in spans:
        attrs = span["attributes"]
        for key in (GEN_AI_RESPONSE_ID, REQUEST_ID):
            if key in attrs and str(attrs[key]) == request_id:
                return True
    return False


def _start_of(spans: Sequence[dict]) -> int:
    root = gateway_root(spans)
    return root["start_ns"] if root is not None else min(s["start_ns"] for s in spans)


def list_requests(path: str | os.PathLike) -> list[RequestRow]:
    """One row per request (trace with a gateway root span) in the span file, oldest first."""
    rows = []
    for tid, spans in _read_traces(path).items():
        root = gateway_root(spans)
        if root is None:
            continue
        attrs = root["attributes"]
        ttft = _number(attrs.get(GEN_AI_TTFT))
        out = _number(attrs.get(GEN_AI_USAGE_OUTPUT_TOKENS))
        rows.append(
            RequestRow(
                request_id=request_id_of(spans),
                trace_id=tid,
                name=root["name"],
                start_ns=root["start_ns"],
                duration_ms=(root["end_ns"] - root["start_ns"]) / 1e6,
                ttft_ms=None if ttft is None else ttft * 1e3,
                output_tokens=None if out is None else int(out),
                status=str(root.get("status") or "UNSET"),
            )
        )
    rows.sort(key=lambda r: r.start_ns)
    return rows


# ---- the span tree ---------------------------------------------------------------------------------------


def operation(span: dict) -> str:
    """What a span is, from its name: "chat", "prefill", "pull_kv", "publish prefill", "process decode", …"""
    name = span.get("name") or ""
    op, _, rest = name.partition(" ")
    if op in (PUBLISH, PROCESS):
        if rest.startswith(PREFILL_SUBJECT):
            return f"{op} {PREFILL}"
        if rest.startswith(DECODE_SUBJECT):
            return f"{op} {DECODE}"
    return op


def gateway_root(spans: Iterable[dict]) -> dict | None:
    """The request's root: the gateway's chat / text_completion span (its parent, if any, is the client's)."""
    roots = [s for s in spans if operation(s) in ROOT_OPERATIONS and s.get("kind", "SERVER") == "SERVER"]
    return min(roots, key=lambda s: s["start_ns"]) if roots else None


def request_id_of(spans: Sequence[dict]) -> str | None:
    root = gateway_root(spans)
    ordered = ([root] if root is not None else []) + list(spans)
    for key in (GEN_AI_RESPONSE_ID, REQUEST_ID):
        for span in ordered:
            if span["attributes"].get(key) is not None:
                return str(span["attributes"][key])
    return None


def _tree(spans: Sequence[dict]) -> list[tuple[dict, int, bool]]:
    """(span, depth, orphan) in depth-first order, children by start; top level: roots and orphans."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[dict]] = {}
    top: list[dict] = []
    for span in spans:
        parent = span.get("parent_span_id")
        if parent and parent in by_id and parent != span["span_id"]:
            children.setdefault(parent, []).append(span)
        else:
            top.append(span)
    root = gateway_root(spans)
    rows: list[tuple[dict, int, bool]] = []
    visited: set[str] = set()

    def walk(span: dict, depth: int, orphan: bool) -> None:
        if span["span_id"] in visited:
            return
        visited.add(span["span_id"])
        rows.append((span, depth, orphan))
        for child in sorted(children.get(span["span_id"], []), key=lambda s: (s["start_ns"], -s["end_ns"])):
            walk(child, depth + 1, False)

    for span in sorted(top, key=lambda s: (s["start_ns"], -s["end_ns"])):
        walk(span, 0, bool(span.get("parent_span_id")) and span is not root)
    for span in spans:  # a parent cycle (a corrupt file): still show every span
        if span["span_id"] not in visited:
            walk(span, 0, True)
    return rows


def _pick(spans: Sequence[dict], op: str, before_ns: int | None = None) -> dict | None:
    """The span of operation `op` (the last started, e.g. after a redelivery), starting before `before_ns`."""
    found = [s for s in spans if operation(s) == op and (before_ns is None or s["start_ns"] <= before_ns)]
    return max(found, key=lambda s: s["start_ns"]) if found else None


def prefill_path_of(spans: Iterable[dict]) -> str | None:
    """The prefill path the gateway chose for the request (remote | local), if its root span says."""
    root = gateway_root(spans)
    path = None if root is None else root["attributes"].get(PREFILL_PATH)
    return None if path is None else str(path)


def _key_spans(spans: Sequence[dict]) -> dict[str, dict | None]:
    pull = _pick(spans, PULL_KV)
    decode = _pick(spans, DECODE)
    # A decode worker that recomputes the prompt may run a prefill span of its own: the prefill phase is the
    # one that came before the transfer.
    prefill = _pick(spans, PREFILL, pull["start_ns"] if pull else None) or _pick(spans, PREFILL)
    # the local prefill path: the gateway published the job straight to the decode queue
    queue = DECODE if prefill_path_of(spans) == "local" else PREFILL
    publish = _pick(spans, f"{PUBLISH} {queue}", prefill["start_ns"] if prefill else None)
    return {
        "root": gateway_root(spans),
        "publish": publish,
        "prefill": prefill,
        "pull_kv": pull,
        "send_kv": _pick(spans, SEND_KV),
        "decode": decode,
    }


def phases(spans: Sequence[dict]) -> list[Phase]:
    """queue (prefill publish start → prefill start), prefill, hand-off (prefill end → pull_kv start; not in
    a mixed worker), kv transfer (pull_kv) and decode, in that order; a phase whose spans are missing (or
    whose clocks disagree: end before start) is left out."""
    k = _key_spans(spans)
    candidates: list[tuple[str, dict | None, dict | None, bool, bool]] = [
        # name, span giving the start, span giving the end, start at its end?, end at its end?
        ("queue", k["publish"], k["prefill"], False, False),
        ("prefill", k["prefill"], k["prefill"], False, True),
        ("hand-off", k["prefill"], k["pull_kv"], True, False),
        ("kv transfer", k["pull_kv"], k["pull_kv"], False, True),
        ("decode", k["decode"], k["decode"], False, True),
    ]
    out = []
    for name, first, last, from_end, to_end in candidates:
        if first is None or last is None:
            continue
        start = first["end_ns"] if from_end else first["start_ns"]
        end = last["end_ns"] if to_end else last["start_ns"]
        if end >= start:
            out.append(Phase(name, start, end))
    return out


def summarize(spans: Sequence[dict]) -> Summary:
    """TTFT, e2e, queue time, TPOT, tokens, finish reasons and the KV transfer (bytes, seconds, outcome), from
    the attributes where the spans carry them, else from the span timings."""
    k = _key_spans(spans)
    root, prefill, pull, send, decode = k["root"], k["prefill"], k["pull_kv"], k["send_kv"], k["decode"]

    def attr(key: str, *where: dict | None):
        for span in [*where, *spans]:
            if span is not None and span["attributes"].get(key) is not None:
                return span["attributes"][key]
        return None

    start = root["start_ns"] if root else min(s["start_ns"] for s in spans) if spans else None
    ttft = _number(attr(GEN_AI_TTFT, root))
    ttft_estimated = False
    first_token = next((e for e in (root or {}).get("events") or [] if e.get("name") == "first_token"), None)
    if ttft is None and root is not None and first_token is not None and isinstance(first_token.get("time_ns"), int):
        ttft = (first_token["time_ns"] - root["start_ns"]) / 1e9  # the gateway's event: the real thing
    if ttft is None and prefill is not None and start is not None:
        ttft, ttft_estimated = (prefill["end_ns"] - start) / 1e9, True
    e2e = _number(attr(E2E_TIME, root))
    if root is not None:
        e2e = (root["end_ns"] - root["start_ns"]) / 1e9
    elif e2e is None and spans:
        e2e = (max(s["end_ns"] for s in spans) - start) / 1e9
    queue = _number(attr(QUEUE_TIME, prefill))
    if queue is None:
        queue_phase = next((p for p in phases(spans) if p.name == "queue"), None)
        queue = queue_phase.duration_ns / 1e9 if queue_phase else None
    reasons = attr(GEN_AI_RESPONSE_FINISH_REASONS, root, decode)
    if reasons is None:
        reasons = ()
    elif isinstance(reasons, str):
        reasons = (reasons,)
    kv_bytes = _number(attr(KV_BYTES, pull, send))
    kv_s = _number(attr(KV_DURATION, pull))
    if kv_s is None and pull is not None:
        kv_s = (pull["end_ns"] - pull["start_ns"]) / 1e9
    inp, out = _number(attr(GEN_AI_USAGE_INPUT_TOKENS, root)), _number(attr(GEN_AI_USAGE_OUTPUT_TOKENS, root, decode))
    outcome = attr(KV_OUTCOME, pull)
    return Summary(
        request_id=request_id_of(spans) if spans else None,
        trace_id=spans[0]["trace_id"] if spans else None,
        ttft_s=ttft,
        e2e_s=e2e,
        queue_s=queue,
        tpot_s=_number(attr(GEN_AI_TPOT, root, decode)),
        input_tokens=None if inp is None else int(inp),
        output_tokens=None if out is None else int(out),
        finish_reasons=tuple(str(r) for r in reasons),
        kv_bytes=None if kv_bytes is None else int(kv_bytes),
        kv_transfer_s=kv_s,
        kv_outcome=None if outcome is None else str(outcome),
        ttft_estimated=ttft_estimated,
        prefill_path=prefill_path_of(spans),
        prefill_path_reason=None if root is None else _text(root["attributes"].get(PREFILL_PATH_REASON)),
        predicted_ttft_s=_number(attr(PREFILL_PATH_PREDICTED_TTFT, root)),
    )


def _text(value) -> str | None:
    return None if value is None else str(value)


def missing_operations(spans: Sequence[dict]) -> list[str]:
    """The operations a complete request has that this trace lacks (P/D or mixed, as far as can be told)."""
    ops = {operation(s) for s in spans}
    services = {s.get("service") for s in spans}
    if prefill_path_of(spans) == "local":  # its root is there; straight to a decode worker, which prefilled it
        return [op for op in (f"{PUBLISH} {DECODE}", f"{PROCESS} {DECODE}", PREFILL, DECODE) if op not in ops]
    expected = [CHAT, f"{PUBLISH} {PREFILL}", f"{PROCESS} {PREFILL}", PREFILL]
    mixed = f"{SERVICE_PREFIX}mixed" in services
    disaggregated = bool(
        ops & {f"{PUBLISH} {DECODE}", f"{PROCESS} {DECODE}", PULL_KV, SEND_KV} or f"{SERVICE_PREFIX}decode" in services
    )
    if disaggregated and not mixed:
        expected += [f"{PUBLISH} {DECODE}", f"{PROCESS} {DECODE}", PULL_KV, SEND_KV]
    expected.append(DECODE)
    if not ops & {*ROOT_OPERATIONS, *expected}:
        return []  # not a request's trace at all
    missing = [] if ops & set(ROOT_OPERATIONS) else [f"{' / '.join(ROOT_OPERATIONS)} (the gateway's root)"]
    return missing + [op for op in expected[1:] if op not in ops]


# ---- text ------------------------------------------------------------------------------------------------


def _number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value) if not (isinstance(value, float) and math.isnan(value)) else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def fmt_ms(ms: float) -> str:
    """Milliseconds with three significant figures or so: 0.125, 4.00, 35.0, 138.0."""
    if abs(ms) < 1:
        return f"{ms:.3f}"
    if abs(ms) < 10:
        return f"{ms:.2f}"
    return f"{ms:.1f}"


def _bar(start_ns: int, end_ns: int, t0: int, total: int, width: int) -> str:
    if total <= 0:
        return "[" + "#" * width + "]"
    first = min(width - 1, max(0, int((start_ns - t0) / total * width)))
    last = min(width, max(first + 1, math.ceil((end_ns - t0) / total * width)))
    return "[" + " " * first + "#" * (last - first) + " " * (width - last) + "]"


def _service(span: dict) -> str:
    service = str(span.get("service") or "?")
    return service.removeprefix(SERVICE_PREFIX)


def _extent(spans: Sequence[dict]) -> tuple[int, int]:
    root = gateway_root(spans)
    t0 = min(s["start_ns"] for s in spans)
    if root is not None:
        t0 = min(t0, root["start_ns"])
    return t0, max(s["end_ns"] for s in spans)


def render_text(spans: Sequence[dict], width: int = BAR_WIDTH) -> str:
    """The timeline of one trace's spans (as load_trace returns them) as text; see the module docstring."""
    if not spans:
        return "no spans\n"
    spans = sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"]))
    t0, t1 = _extent(spans)
    total = t1 - t0
    summary = summarize(spans)
    root = gateway_root(spans)
    e2e_ns = (root["end_ns"] - root["start_ns"]) if root is not None else total
    rows = _tree(spans)

    lines = []
    head = f"request {summary.request_id or '?'}  trace {summary.trace_id}"
    if root is not None:
        head += f"  {root['name']}"
    head += f"  {'e2e' if root is not None else 'span extent'} {fmt_ms(e2e_ns / 1e6)} ms"
    lines += [head, ""]

    labels = [("  " * depth) + ("? " if orphan else "") + span["name"] for span, depth, orphan in rows]
    name_w = max(max(len(label) for label in labels), len("span"))
    service_w = max(max(len(_service(s)) for s, _, _ in rows), len("service"))
    end_label = f"{fmt_ms(total / 1e6)} ms"
    scale = "0 ms" + end_label.rjust(width + 2 - len("0 ms"))
    lines.append(f"{'span':<{name_w}}  {'service':<{service_w}}  {'start ms':>9}  {'dur ms':>8}  {scale}")
    errors = []
    for (span, _, _), label in zip(rows, labels, strict=True):
        mark = " !" if span.get("status") == "ERROR" else ""
        if mark:
            errors.append(f"! {span['name']}: {span.get('status_message') or 'error'}")
        offset, dur = (span["start_ns"] - t0) / 1e6, (span["end_ns"] - span["start_ns"]) / 1e6
        lines.append(
            f"{label + mark:<{name_w}}  {_service(span):<{service_w}}  {fmt_ms(offset):>9}  {fmt_ms(dur):>8}  "
            + _bar(span["start_ns"], span["end_ns"], t0, total, width)
        )

    found = phases(spans)
    if found:
        lines += ["", f"{'phase':<12}  {'ms':>9}  {'% e2e':>6}"]
        for phase in found:
            pct = f"{100 * phase.duration_ns / e2e_ns:5.1f}%" if e2e_ns > 0 else "     -"
            lines.append(
                f"{phase.name:<12}  {fmt_ms(phase.duration_ms):>9}  {pct:>6}  "
                + _bar(phase.start_ns, phase.end_ns, t0, total, width)
            )

    lines.append("")
    facts = []
    if summary.ttft_s is not None:
        facts.append(f"TTFT {'~' if summary.ttft_estimated else ''}{fmt_ms(summary.ttft_s * 1e3)} ms")
    if summary.tpot_s is not None:
        facts.append(f"TPOT {summary.tpot_s * 1e3:.2f} ms")
    if summary.e2e_s is not None:
        facts.append(f"e2e {fmt_ms(summary.e2e_s * 1e3)} ms")
    if summary.queue_s is not None:
        facts.append(f"queue {fmt_ms(summary.queue_s * 1e3)} ms")
    if facts:
        lines.append("  ".join(facts))
    if summary.prefill_path is not None:
        path = f"prefill path {summary.prefill_path}"
        if summary.prefill_path_reason is not None:
            path += f" ({summary.prefill_path_reason})"
        if summary.predicted_ttft_s is not None:
            actual = "?" if summary.ttft_s is None else f"{fmt_ms(summary.ttft_s * 1e3)} ms"
            path += f": TTFT predicted {fmt_ms(summary.predicted_ttft_s * 1e3)} ms, actual {actual}"
        lines.append(path)
    facts = []
    if summary.input_tokens is not None or summary.output_tokens is not None:
        inp = "?" if summary.input_tokens is None else summary.input_tokens
        out = "?" if summary.output_tokens is None else summary.output_tokens
        facts.append(f"tokens {inp} in / {out} out")
    if summary.finish_reasons:
        facts.append(f"finish {','.join(summary.finish_reasons)}")
    if facts:
        lines.append("  ".join(facts))
    if summary.kv_bytes is not None or summary.kv_outcome is not None:
        kv = f"kv {summary.kv_bytes:,} bytes" if summary.kv_bytes is not None else "kv ? bytes"
        if summary.kv_transfer_s is not None:
            kv += f" in {fmt_ms(summary.kv_transfer_s * 1e3)} ms"
        if summary.kv_gbps is not None:
            kv += f" = {summary.kv_gbps:.2f} GB/s"
        if summary.kv_outcome is not None:
            kv += f" ({summary.kv_outcome})"
        lines.append(kv)

    notes = list(errors)
    if any(orphan for _, _, orphan in rows):
        notes.append("? its parent span is not in the file (not flushed yet, or its process was killed)")
    missing = missing_operations(spans)
    if missing:
        notes.append("not in the file: " + ", ".join(missing))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def render_list(rows: Sequence[RequestRow]) -> str:
    """The requests of a span file (list_requests), one line each."""
    if not rows:
        return "no requests (no chat / text_completion root span) in the file\n"
    id_w = max(len("request id"), *(len(r.request_id or "?") for r in rows))
    lines = [
        f"{'start':<23}  {'request id':<{id_w}}  {'trace id':<32}  {'e2e ms':>8}  {'TTFT ms':>8}  {'out':>5}  name"
    ]
    for r in rows:
        when = datetime.fromtimestamp(r.start_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        ttft = "-" if r.ttft_ms is None else fmt_ms(r.ttft_ms)
        out = "-" if r.output_tokens is None else str(r.output_tokens)
        name = r.name + ("  ERROR" if r.status == "ERROR" else "")
        lines.append(
            f"{when:<23}  {r.request_id or '?':<{id_w}}  {r.trace_id:<32}  {fmt_ms(r.duration_ms):>8}  {ttft:>8}  "
            f"{out:>5}  {name}"
        )
    return "\n".join(lines) + "\n"


# ---- png -------------------------------------------------------------------------------------------------

SERVICE_COLORS = {
    "gateway": "#4C72B0",
    "prefill": "#DD8452",
    "decode": "#55A868",
    "mixed": "#8172B3",
}
PHASE_COLORS = {
    "queue": "#BBBBBB",
    "prefill": "#F2C49B",
    "hand-off": "#F5E28C",
    "kv transfer": "#E8A0A0",
    "decode": "#A6D8A8",
}


def render_png(spans: Sequence[dict], out_path: str | os.PathLike) -> Path:
    """A Gantt chart of one trace: a bar per span colored by service, x in ms from the request start, the
    phases shaded behind; written with matplotlib's Agg canvas (no display, no pyplot state)."""
    if not spans:
        raise ValueError("no spans to draw")
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spans = sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"]))
    t0, t1 = _extent(spans)
    rows = _tree(spans)
    summary = summarize(spans)
    root = gateway_root(spans)
    total_ms = max((t1 - t0) / 1e6, 1e-6)

    fig = Figure(figsize=(12, max(2.8, 0.42 * len(rows) + 1.8)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    phase_list = phases(spans)
    for phase in phase_list:
        ax.axvspan(
            (phase.start_ns - t0) / 1e6,
            (phase.end_ns - t0) / 1e6,
            color=PHASE_COLORS.get(phase.name, "#DDDDDD"),
            alpha=0.35,
            zorder=0,
            linewidth=0,
        )
    labels = []
    services_seen: dict[str, str] = {}
    for y, (span, depth, orphan) in enumerate(rows):
        service = _service(span)
        color = SERVICE_COLORS.get(service, "#937860")
        services_seen.setdefault(service, color)
        left, dur = (span["start_ns"] - t0) / 1e6, (span["end_ns"] - span["start_ns"]) / 1e6
        error = span.get("status") == "ERROR"
        ax.barh(
            y,
            max(dur, total_ms / 500),
            left=left,
            height=0.6,
            color=color,
            edgecolor="#C44E52" if error else "black",
            linewidth=1.5 if error else 0.4,
            hatch="//" if error else None,
            zorder=2,
        )
        ax.text(left + max(dur, 0) + total_ms * 0.005, y, f"{fmt_ms(dur)} ms", va="center", fontsize=8, zorder=3)
        labels.append(("  " * depth) + ("? " if orphan else "") + span["name"])
    ax.set_yticks(range(len(rows)), labels, fontfamily="monospace", fontsize=8, ha="left")
    ax.tick_params(axis="y", pad=max(len(label) for label in labels) * 5.2, length=0)
    ax.set_ylim(len(rows) - 0.5, -0.7)
    ax.set_xlim(0, total_ms * 1.12)
    ax.set_xlabel("ms from the request start")
    ax.grid(axis="x", alpha=0.3, zorder=1)

    if summary.ttft_s is not None and root is not None:
        ttft_x = (root["start_ns"] - t0) / 1e6 + summary.ttft_s * 1e3
        ax.axvline(ttft_x, color="#C44E52", linestyle="--", linewidth=1, zorder=3)
    ttft = f"{'~' if summary.ttft_estimated else ''}{fmt_ms(summary.ttft_s * 1e3)} ms" if summary.ttft_s else "?"
    e2e = f"{fmt_ms(summary.e2e_s * 1e3)} ms" if summary.e2e_s else "?"
    ax.set_title(f"{summary.request_id or summary.trace_id}  -  TTFT {ttft}, e2e {e2e}", fontsize=11)
    handles: list[Artist] = [
        Patch(facecolor=c, edgecolor="black", linewidth=0.4, label=s) for s, c in services_seen.items()
    ]
    if summary.ttft_s is not None and root is not None:
        handles.append(Line2D([], [], color="#C44E52", linestyle="--", linewidth=1, label="first token"))
    handles += [
        Patch(facecolor=PHASE_COLORS.get(p.name, "#DDDDDD"), alpha=0.35, label=f"{p.name} {fmt_ms(p.duration_ms)} ms")
        for p in phase_list
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


# ---- command line ----------------------------------------------------------------------------------------


def add_trace_command(subparsers) -> argparse.ArgumentParser:
    """Register `pdserve trace SPANS_FILE [--request-id ID | --trace-id ID] [--png OUT.png] [--list]`."""
    p = subparsers.add_parser(
        "trace",
        help="one request's timeline from a span file (pdserve up --trace-file)",
        description=(__doc__ or "").split("\n\n")[0],  # None under python -OO
    )
    p.add_argument("spans_file", help="the JSON-lines span file that pdserve up --trace-file wrote")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--request-id", help="the id the client saw (chatcmpl-…, cmpl-…); default: the latest")
    which.add_argument("--trace-id", help="a trace id, or its first few hex digits")
    p.add_argument("--png", metavar="OUT.png", help="also draw the timeline as a Gantt chart")
    p.add_argument("--list", action="store_true", help="list the requests in the file instead")
    p.add_argument("--width", type=int, default=BAR_WIDTH, help=f"bar width in columns (default {BAR_WIDTH})")
    p.set_defaults(func=trace_command)
    return p


def trace_command(args: argparse.Namespace) -> int:
    try:
        if args.list:
            sys.stdout.write(render_list(list_requests(args.spans_file)))
            return 0
        spans = load_trace(args.spans_file, request_id=args.request_id, trace_id=args.trace_id)
        sys.stdout.write(render_text(spans, width=max(10, args.width)))
        if args.png:
            print(f"wrote {render_png(spans, args.png)}")
    except (ValueError, OSError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return 0
