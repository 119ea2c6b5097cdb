"""A real OTLP/HTTP trace receiver for tests: decodes the protobuf `ExportTraceServiceRequest` that
services send to <endpoint>/v1/traces and keeps every span as a plain dict (same keys as spanfile.py)."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                receiver._add(request)
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex() or None,
                            "name": s.name,
                            "kind": _KINDS.get(s.kind, str(s.kind)),
                            "service": resource.get("service.name", ""),
                            "start_ns": s.start_time_unix_nano,
                            "end_ns": s.end_time_unix_nano,
                            "status": {0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code],
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events],
                        }
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def all_spans(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, predicate, timeout_s: float = 15.0):
        """Poll until predicate(self) is truthy; return its value (or the last falsy one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate(self)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.1)
