"""Prometheus metrics of every service, vLLM-style names under the `pdserve:` prefix, each labelled with
`model_name` and `role` (gateway | prefill | decode | mixed).

Who records what:
    gateway      time_to_first_token, inter_token_latency, request_time_per_output_token,
                 e2e_request_latency (as the client sees them) and request_success by finished_reason, each
                 also labelled with the request's prefill `path` (remote | local | none), prompt/generation
                 tokens returned, num_requests_running (in flight),
                 requests_rejected by reason (admission, draining), prefill_routes by how (KV-aware routing:
                 prefix | affinity | shared) and routed_prefix_hit_tokens (the cached tokens it predicted)
    workers      request_queue_time (created at the gateway → first scheduled), prompt/generation tokens
                 the engine computed and sampled, num_requests_running|waiting, kv_cache_usage_perc,
                 kv_cache_group_usage_perc|free_blocks|num_blocks (every KV cache group, label `group`),
                 prefix_cache_queries|hits (prompt tokens looked up | found cached), prefix_cache_hit_rate,
                 prefix_cache_blocks (cached now), prefix_cache_evictions (KV cache group 0's),
                 moe_expert_tokens (routed tokens per layer and expert); with expert parallelism
                 moe_rank_tokens (pairs each EP rank computed) and moe_rank_imbalance (busiest rank / mean);
                 with --eplb eplb_rebalances, eplb_bytes_moved, eplb_pause_seconds, eplb_window_imbalance;
                 worker_role (1 for the role served now), role_switches by from/to role and outcome,
                 role_switch_seconds, role_switch_handed_on
    transfers    kv_transfer_seconds / bytes / failures: decode side (pull) and prefill side (send); kv_pulls by
                 `transport` (same-host shared memory or over the pair's network connection)
    planner      planner_desired_workers (label `role`: the worker role wanted), planner_forecast_requests_per_second,
                 planner_decisions by action

Summed over the workers of a P/D stack, generation tokens equal the gateway's: a worker counts the tokens it
emits (the prefill worker each request's first token, the decode worker the rest, or all of them for a request
on the local prefill path; a layer-streamed request's
first token is emitted and counted by the decode worker, whether it came in the pull's trailer or was sampled
there after a failed pull). Metrics live in the process-wide default
registry; the gateway serves them at /metrics, a worker on its own port (`serve_metrics`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` series beside every counter: nothing here reads them

PREFIX = "pdserve:"
LABELS = ("model_name", "role")

# CPU steps run from a few ms to seconds; GPUs go below 1 ms. Upper ends cover long queues.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip

# the gateway's request metrics also carry the prefill path the request took: remote | local (none: never dispatched)
REQUEST_LABELS = (*LABELS, "path")
TIME_TO_FIRST_TOKEN = Histogram(
    f"{PREFIX}time_to_first_token_seconds",
    "Request received → first token sent.",
    REQUEST_LABELS,
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    f"{PREFIX}inter_token_latency_seconds",
    "Gap between consecutive output tokens.",
    REQUEST_LABELS,
    buckets=_TOKEN_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    f"{PREFIX}request_time_per_output_token_seconds",
    "Per request: (e2e - TTFT) / (output tokens - 1).",
    REQUEST_LABELS,
    buckets=_TOKEN_BUCKETS,
)
E2E_LATENCY = Histogram(
    f"{PREFIX}e2e_request_latency_seconds",
    "Request received → last token sent.",
    REQUEST_LABELS,
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    f"{PREFIX}request_queue_time_seconds",
    "Request created at the gateway → first scheduled by an engine.",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens (gateway: of answered requests).", LABELS)
GENERATION_TOKENS = Counter(f"{PREFIX}generation_tokens", "Generated tokens (gateway: returned to clients).", LABELS)
REQUEST_SUCCESS = Counter(
    f"{PREFIX}request_success", "Finished requests by finish reason.", (*REQUEST_LABELS, "finished_reason")
)
REQUESTS_REJECTED = Counter(
    f"{PREFIX}requests_rejected",
    "Requests the gateway refused before dispatch: queue | kv | ttft_slo (admission bounds, 429), draining (503).",
    (*LABELS, "reason"),
)
PREFILL_ROUTES = Counter(
    f"{PREFIX}prefill_routes",
    "Prefill jobs by where the gateway sent them: prefix (the worker holding the prompt's prefix), affinity (its "
    "prompt_cache_key's worker), shared (the shared queue: nothing cached helps, routing off, no index yet).",
    (*LABELS, "how"),
)
DECODE_ROUTES = Counter(
    f"{PREFIX}decode_routes",
    "Decode jobs the gateway routed to the decode worker whose cache holds most of the prompt (decode-side reuse); "
    "the others go to the shared decode queue.",
    LABELS,
)
DECODE_AFFINITY_ROUTES = Counter(
    f"{PREFIX}decode_affinity_routes",
    "Decode jobs the prefill worker handed on by expert affinity (the gateway's expert_affinity_routing): matched "
    "(to the decode worker whose hot experts overlap the prompt's most), shared (none overlapped: the shared queue).",
    (*LABELS, "outcome"),
)
ROUTED_PREFIX_HIT_TOKENS = Counter(
    f"{PREFIX}routed_prefix_hit_tokens",
    "Prompt tokens the gateway predicted the chosen worker holds in its prefix cache (KV-aware routing).",
    LABELS,
)
REQUESTS_RUNNING = Gauge(f"{PREFIX}num_requests_running", "Requests being computed (gateway: in flight).", LABELS)
REQUESTS_WAITING = Gauge(f"{PREFIX}num_requests_waiting", "Requests queued in the engine.", LABELS)
KV_CACHE_USAGE = Gauge(
    f"{PREFIX}kv_cache_usage_perc", "Fraction of KV blocks in use (0-1, as vLLM; KV cache group 0's).", LABELS
)
# KV cache groups (shared/engine/kv_groups.py): group 0 the full layers, then one per sliding window, ascending
KV_CACHE_GROUP_USAGE = Gauge(
    f"{PREFIX}kv_cache_group_usage_perc", "Fraction of a KV cache group's blocks in use (0-1).", (*LABELS, "group")
)
KV_CACHE_GROUP_FREE_BLOCKS = Gauge(
    f"{PREFIX}kv_cache_group_free_blocks", "Free KV blocks of a KV cache group.", (*LABELS, "group")
)
KV_CACHE_GROUP_BLOCKS = Gauge(
    f"{PREFIX}kv_cache_group_num_blocks", "KV blocks of a KV cache group.", (*LABELS, "group")
)
# Prefix caching (shared/engine/prefix_caching.py): the engine's cumulative stats, advanced at each heartbeat
PREFIX_CACHE_QUERIES = Counter(
    f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at first admission).", LABELS
)
PREFIX_CACHE_HITS = Counter(
    f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", LABELS
)
PREFIX_CACHE_HIT_RATE = Gauge(
    f"{PREFIX}prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since the engine started.", LABELS
)
PREFIX_CACHE_BLOCKS = Gauge(
    f"{PREFIX}prefix_cache_blocks", "KV blocks held in the prefix cache now (referenced or evictable).", LABELS
)
PREFIX_CACHE_EVICTIONS = Counter(
    f"{PREFIX}prefix_cache_evictions", "Cached KV blocks evicted to make room (least recently used first).", LABELS
)
_prefix_seen: dict[tuple[str, str], tuple[int, int, int]] = {}  # labels → the totals last recorded
KV_TRANSFER_SECONDS = Histogram(
    f"{PREFIX}kv_transfer_seconds",
    "One KV transfer: pull (decode) or export + send (prefill).",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
KV_TRANSFER_BYTES = Counter(f"{PREFIX}kv_transfer_bytes", "KV bytes moved.", LABELS)
KV_SKIPPED_BLOCKS = Counter(
    f"{PREFIX}kv_transfer_skipped_blocks",
    "KV blocks a decode worker did not pull: its own prefix cache held them (partial pulls, docs/kv_transfer.md).",
    LABELS,
)
KV_LAYER_STREAMED = Counter(
    f"{PREFIX}kv_layer_streamed_pulls", "KV pulls sent layer by layer as the prefill ran (docs/kv_transfer.md).", LABELS
)
KV_POSTED_PULLS = Counter(
    f"{PREFIX}kv_posted_pulls",
    'KV pulls sent into receives the puller posted before its Pull (docs/kv_transfer.md, "Pre-posted pulls").',
    LABELS,
)
KV_LOCAL_PULLS = Counter(
    f"{PREFIX}kv_local_pulls",
    "KV pulls asked over a same-host prefill worker's Unix socket, not gRPC (docs/kv_transfer.md).",
    LABELS,
)
KV_BORROWED_PULLS = Counter(
    f"{PREFIX}kv_borrowed_pulls",
    "KV pulls lent in place by a same-host prefill worker, copied from its mapped pool (docs/kv_transfer.md).",
    LABELS,
)
KV_TRANSFER_FAILURES = Counter(f"{PREFIX}kv_transfer_failures", "Failed KV transfers.", (*LABELS, "reason"))
# Which way each pull's bytes went (shared/kv/transfer/transports/registry.py names them): "borrowed" and "segment"
# are same-host paths (shared memory), "streamed", "posted" and "pair" go over the pair's network connection.
KV_PULLS = Counter(
    f"{PREFIX}kv_pulls",
    "KV pulls by the transport that carried them: prefill, pulls each transport took; decode, pulls received "
    "through each (docs/kv_transfer.md).",
    (*LABELS, "transport"),
)
REQUEST_MIGRATIONS = Counter(
    f"{PREFIX}request_migrations",
    "Requests moved to another worker (their worker died or stalled), by the phase they were in.",
    (*LABELS, "phase"),
)
TOKEN_EVENTS_RESENT = Counter(
    f"{PREFIX}token_events_resent",
    "Token events a worker published again: a gateway asked for positions it lacked, or NATS reconnected.",
    LABELS,
)
TOKEN_RESEND_ASKS = Counter(
    f"{PREFIX}token_resend_asks",
    "Requests whose missing token events the gateway asked the workers for again, one per request and ask.",
    (*LABELS, "why"),
)
MOE_EXPERT_TOKENS = Counter(
    f"{PREFIX}moe_expert_tokens", "Tokens routed to each expert (top-k counts each).", (*LABELS, "layer", "expert")
)

MOE_RANK_TOKENS = Counter(
    f"{PREFIX}moe_rank_tokens",
    "Expert parallelism: (token, expert) pairs each rank of the worker group computed, all sparse layers.",
    (*LABELS, "rank"),
)
MOE_RANK_IMBALANCE = Gauge(
    f"{PREFIX}moe_rank_imbalance",
    "Expert parallelism: the busiest rank's pairs over the mean rank's, per layer step, weighted over the "
    "steps since the previous heartbeat (1 = balanced; the MoE layers wait for the busiest rank).",
    LABELS,
)
MOE_RANK_IMBALANCE_HIST = Histogram(
    f"{PREFIX}moe_rank_imbalance_ratio",
    "Expert parallelism: moe_rank_imbalance, observed once per heartbeat interval that saw MoE traffic.",
    LABELS,
    buckets=(1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 8.0),
)

# live expert re-placement (--eplb, shared/parallel/eplb.py): per role, since each role's group plans from its own load
EPLB_REBALANCES = Counter(
    f"{PREFIX}eplb_rebalances", "Live expert re-placements swapped in on every rank of the worker group.", LABELS
)
EPLB_BYTES_MOVED = Counter(
    f"{PREFIX}eplb_bytes_moved", "Expert weight bytes sent between the ranks by live re-placement.", LABELS
)
EPLB_PAUSE_SECONDS = Histogram(
    f"{PREFIX}eplb_pause_seconds",
    "Live expert re-placement: the time one step boundary spent staging a layer's slots or swapping them in.",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
EPLB_WINDOW_IMBALANCE = Gauge(
    f"{PREFIX}eplb_window_imbalance",
    "Live expert re-placement: the serving placement's predicted busiest-rank / mean load over the window, at the "
    "last plan (moe_rank_imbalance is the measured one, per heartbeat interval).",
    LABELS,
)

# the SLO planner (services/planner): here `role` is the worker role it plans for, not the recording service's
PLANNER_DESIRED_WORKERS = Gauge(
    f"{PREFIX}planner_desired_workers",
    "The SLO planner: the workers of this role it wants (the fewest that keep the role's SLO with headroom, under "
    "the forecast load): what an autoscaler scales the role's replicas to.",
    LABELS,
)
PLANNER_FORECAST_RATE = Gauge(
    f"{PREFIX}planner_forecast_requests_per_second",
    "The SLO planner: the request rate it forecasts for the next interval.",
    ("model_name",),
)
PLANNER_DECISIONS = Counter(
    f"{PREFIX}planner_decisions",
    "The SLO planner's decisions by action: hold | switch (a worker told to change role) | failed (the switch was "
    "refused or did not complete).",
    ("model_name", "action"),
)
# role switching (shared/worker/host.py, docs/architecture.md "Role switching")
WORKER_ROLE = Gauge(
    f"{PREFIX}worker_role", "1 for the role this worker serves now, 0 for the others (it may switch).", LABELS
)
ROLE_SWITCHES = Counter(
    f"{PREFIX}role_switches",
    "Role switches asked of this worker, by the role left, the role asked for and how it ended (switched, "
    "timed_out, same_role, busy, refused, invalid, stopping).",
    ("model_name", "from_role", "to_role", "outcome"),
)
ROLE_SWITCH_SECONDS = Histogram(
    f"{PREFIX}role_switch_seconds",
    "Completed role switches: order received → the new role serving (what the old role held finished, was "
    "handed on or pulled first).",
    ("model_name", "from_role", "to_role"),
    buckets=_LATENCY_BUCKETS,
)
ROLE_SWITCH_HANDED_ON = Counter(
    f"{PREFIX}role_switch_handed_on",
    "Requests a decode or mixed worker leaving its role handed to the prefill queue with their tokens so far.",
    LABELS,
)


def exposition() -> tuple[bytes, str]:
    """The current text exposition and its content type (for a /metrics route)."""
    return generate_latest(), CONTENT_TYPE_LATEST


Probe = Callable[[], tuple[bool, str]]  # (ok, why): 200 or 503 on its path


class _MetricsServer(ThreadingHTTPServer):
    probes: Mapping[str, Probe] = {}


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?")[0]
        probes = self.server.probes if isinstance(self.server, _MetricsServer) else {}
        if path in probes:
            ok, why = probes[path]()
            body = json.dumps({"status": "ok" if ok else "unavailable", "detail": why}).encode()
            self._send(200 if ok else 503, body, "application/json")
            return
        if path not in ("/metrics", "/"):
            self.send_error(404)
            return
        body, content_type = exposition()
        self._send(200, body, content_type)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # one line per scrape would drown the worker's log
        pass


def serve_metrics(host: str, port: int, probes: Mapping[str, Probe] | None = None) -> int:
    """Serve /metrics from a daemon thread; returns the bound port (port 0: any free one). `probes`: more paths,
    each answered 200 or 503 with JSON `{"status", "detail"}` from its probe, called on the server's thread (a
    worker's /health and /ready: shared/worker/probes.py).

    Always the classic text format, like the gateway's route: prometheus_client's own server negotiates
    OpenMetrics with Prometheus 2.x and then rewrites the `pdserve:` names to `pdserve_`."""
    server = _MetricsServer((host, port), _MetricsHandler)
    server.probes = dict(probes or {})
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port


def record_expert_load(model_name: str, role: str, load: dict[int, list[int]]) -> None:
    """Add per-layer expert counts (layer index → tokens per expert) to the expert-load counter."""
    for layer, counts in load.items():
        for expert, n in enumerate(counts):
            if n:
                MOE_EXPERT_TOKENS.labels(model_name, role, str(layer), str(expert)).inc(n)


def record_rank_load(model_name: str, role: str, per_rank: list[int], imbalance: float) -> None:
    """Add each EP rank's pairs since the last call; set and observe the interval's imbalance (when it had
    traffic: an idle interval says nothing about balance)."""
    for rank, n in enumerate(per_rank):
        MOE_RANK_TOKENS.labels(model_name, role, str(rank)).inc(n)
    if sum(per_rank):
        MOE_RANK_IMBALANCE.labels(model_name, role).set(imbalance)
        MOE_RANK_IMBALANCE_HIST.labels(model_name, role).observe(imbalance)


def record_prefix_cache(
    model_name: str, role: str, queried: int, hits: int, evictions: int, blocks: int, hit_rate: float
) -> None:
    """Advance the prefix-cache counters to the engine's totals (an engine started afresh in this process counts
    from zero again) and set the gauges."""
    labels = (model_name, role)
    seen = _prefix_seen.get(labels, (0, 0, 0))
    totals = (queried, hits, evictions)
    counters = (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_EVICTIONS)
    for counter, now, before in zip(counters, totals, seen, strict=True):
        counter.labels(*labels).inc(now - before if now >= before else now)
    _prefix_seen[labels] = totals
    PREFIX_CACHE_HIT_RATE.labels(*labels).set(hit_rate)
    PREFIX_CACHE_BLOCKS.labels(*labels).set(blocks)


def record_eplb(
    model_name: str, role: str, rebalances: int, bytes_moved: int, pauses_s: list[float], window: float | None
) -> None:
    """Add what live expert re-placement did since the last call; set the window's predicted imbalance."""
    labels = (model_name, role)
    EPLB_REBALANCES.labels(*labels).inc(rebalances)
    EPLB_BYTES_MOVED.labels(*labels).inc(bytes_moved)
    for pause in pauses_s:
        EPLB_PAUSE_SECONDS.labels(*labels).observe(pause)
    if window is not None:
        EPLB_WINDOW_IMBALANCE.labels(*labels).set(window)
