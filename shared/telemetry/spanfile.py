"""Spans as JSON lines: an exporter that appends finished spans to a local file, and its reader.

Every process of a `pdserve up --trace-file F` stack appends to the same file: each batch is written
with one `write` on an O_APPEND descriptor, so lines from different processes never interleave.

One line per span:
    {"trace_id": 32 hex, "span_id": 16 hex, "parent_span_id": 16 hex | null, "name", "kind",
     "service", "start_ns", "end_ns", "status", "status_message", "attributes": {...},
     "events": [{"name", "time_ns", "attributes"}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    assert ctx is not None, span.name  # the SDK's spans carry one from the start; only the type allows None
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        try:
            os.write(self._fd, data)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_spans(path: str | os.PathLike) -> Iterator[dict]:
    """The span records in `path`; a line cut short (a process killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "trace_id" in record:
                yield record
