"""One request as the gateway observes it: its server span (the root of the request's trace, or a child of
the client's `traceparent`) and the client-side latency metrics — TTFT, inter-token latency, TPOT, e2e —
plus the token counters, all measured from when the handler took the request.

Life: `RequestObserver(...)` when the request is valid → `dispatched(choice)` once its job is sent down its prefill
path (the metrics' `path` label, the path's attributes on the span) → `tokens(n)` per update as its tokens are
handed to the client → `end(...)` exactly once (later calls are ignored).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from services.gateway.backend import RequestStatsSink
from services.gateway.prefill_path import PathChoice
from shared.messages import RequestArrived, RequestEnded
from shared.telemetry import metrics, tracing

ROLE = "gateway"
NOT_DISPATCHED = "none"  # the path label of a request that never left the gateway


class RequestObserver:
    def __init__(
        self,
        operation: str,  # tracing.CHAT | tracing.TEXT_COMPLETION
        model: str,
        request_id: str,
        headers: Mapping[str, str],
        arrived: tuple[float, float],  # (time.time(), time.perf_counter()) when the handler took it
        max_tokens: int,
        prompt_tokens: int,
        stats: RequestStatsSink | None = None,  # where the request's arrival and end are told (the SLO planner)
    ) -> None:
        self.labels = (model, ROLE)
        self.request_id = request_id
        self.max_tokens = max_tokens
        self._stats = stats
        self._ttft: float | None = None
        self._tpot: float | None = None
        self._sent = False
        self.path = NOT_DISPATCHED
        self.prompt_tokens = prompt_tokens
        self._arrived = arrived[1]
        self._first: float | None = None
        self._last: float = 0.0
        self._ended = False
        self.span = tracing.start_span(
            f"{operation} {model}",
            tracing.extract(headers),
            arrived[0],
            kind=trace.SpanKind.SERVER,
            attributes={
                tracing.GEN_AI_SYSTEM: "pdserve",
                tracing.GEN_AI_OPERATION: operation,
                tracing.GEN_AI_REQUEST_MODEL: model,
                tracing.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                tracing.GEN_AI_RESPONSE_ID: request_id,
                tracing.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
                tracing.REQUEST_ID: request_id,
            },
        )
        metrics.REQUESTS_RUNNING.labels(*self.labels).inc()

    def trace_context(self) -> dict[str, str]:
        """The carrier that makes the job's publish span a child of this request's span."""
        return tracing.carrier(trace.set_span_in_context(self.span))

    def dispatched(self, choice: PathChoice | None) -> None:
        """The request's job left down `choice`'s path (None: a backend that does not choose one). From here on it
        counts as an arrival of the load the SLO planner forecasts."""
        self._sent = True
        if choice is not None:
            self.path = choice.path.value
            self.span.set_attributes(path_attributes(choice))
        if self._stats is not None:
            self._stats.record_stat(
                RequestArrived(
                    gateway_id=self._stats.gateway_id,
                    request_id=self.request_id,
                    prompt_tokens=self.prompt_tokens,
                    at=time.time(),
                    max_tokens=self.max_tokens,
                )
            )

    def tokens(self, n: int) -> None:
        """`n` more tokens reach the client now."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            metrics.TIME_TO_FIRST_TOKEN.labels(*self.labels, self.path).observe(now - self._arrived)
            self.span.add_event("first_token")
        else:
            metrics.INTER_TOKEN_LATENCY.labels(*self.labels, self.path).observe(now - self._last)
        for _ in range(n - 1):  # tokens that arrived together: no gap between them
            metrics.INTER_TOKEN_LATENCY.labels(*self.labels, self.path).observe(0.0)
        self._last = now

    def end(self, finish_reason: str, completion_tokens: int, error: str | None = None, status: int = 200) -> None:
        """The request is over: `finish_reason` stop | length | abort (client gone) | error."""
        if self._ended:
            return
        self._ended = True
        m = metrics
        m.REQUESTS_RUNNING.labels(*self.labels).dec()
        m.REQUEST_SUCCESS.labels(*self.labels, self.path, finish_reason).inc()
        m.GENERATION_TOKENS.labels(*self.labels).inc(completion_tokens)
        attributes: dict[str, AttributeValue] = {
            tracing.GEN_AI_USAGE_OUTPUT_TOKENS: completion_tokens,
            tracing.GEN_AI_RESPONSE_FINISH_REASONS: (finish_reason,),
            "http.response.status_code": status,
        }
        if self._first is not None:  # e2e ends at the last token (TPOT = (e2e - TTFT) / (tokens - 1))
            e2e = self._last - self._arrived
            m.PROMPT_TOKENS.labels(*self.labels).inc(self.prompt_tokens)
            m.E2E_LATENCY.labels(*self.labels, self.path).observe(e2e)
            attributes[tracing.E2E_TIME] = e2e
            attributes[tracing.GEN_AI_TTFT] = self._ttft = self._first - self._arrived
            if completion_tokens > 1:
                tpot = self._tpot = (self._last - self._first) / (completion_tokens - 1)
                m.TIME_PER_OUTPUT_TOKEN.labels(*self.labels, self.path).observe(tpot)
                attributes[tracing.GEN_AI_TPOT] = tpot
        self.span.set_attributes(attributes)
        tracing.end_span(self.span, error=error)
        if self._stats is not None and self._sent:
            self._stats.record_stat(
                RequestEnded(
                    gateway_id=self._stats.gateway_id,
                    request_id=self.request_id,
                    prompt_tokens=self.prompt_tokens,
                    at=time.time(),
                    output_tokens=completion_tokens,
                    ttft_s=self._ttft,
                    tpot_s=self._tpot,
                    finish_reason=finish_reason,
                )
            )


def path_attributes(choice: PathChoice) -> dict[str, AttributeValue]:
    """The span attributes of a prefill path choice: the path, why, and each path's predictions (the actual TTFT
    is the span's gen_ai.server.time_to_first_token)."""
    attributes: dict[str, AttributeValue] = {
        tracing.PREFILL_PATH: choice.path.value,
        tracing.PREFILL_PATH_REASON: choice.reason,
    }
    predicted = choice.predicted_ttft_s
    if predicted is not None:
        attributes[tracing.PREFILL_PATH_PREDICTED_TTFT] = predicted
    if choice.remote is not None:
        attributes[tracing.PREFILL_PATH_REMOTE_TTFT] = choice.remote.ttft_s
        attributes[tracing.PREFILL_PATH_REMOTE_READY] = choice.remote.ready_s
    if choice.local is not None:
        attributes[tracing.PREFILL_PATH_LOCAL_TTFT] = choice.local.ttft_s
    if choice.decode_slowdown_s is not None:
        attributes[tracing.PREFILL_PATH_DECODE_SLOWDOWN] = choice.decode_slowdown_s
    if choice.decode_tpot_s is not None and choice.decode_tpot_s != float("inf"):
        attributes[tracing.PREFILL_PATH_DECODE_TPOT] = choice.decode_tpot_s
    return attributes
