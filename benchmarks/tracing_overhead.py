"""What tracing costs: TTFT, output throughput and worker CPU with tracing off, exporting over OTLP/HTTP, and
writing a span file, on the same workload in one run; plus the in-process cost of one span.

    .venv/bin/python benchmarks/tracing_overhead.py [--size tiny|small] [--rounds 8] [--requests 32]
        [--concurrency 4] [--prompt-tokens 64] [--max-tokens 32] [--modes off otlp file off2] [--out JSON]

One stack per mode, all started up front by `pdserve up`'s launcher (nats-server, redis-server, gateway,
1 prefill + 1 decode worker, one torch thread per worker), each on its own port:
- off: no OTEL_* variable and no span file: no SDK provider, the API's no-op tracer;
- otlp: OTEL_EXPORTER_OTLP_ENDPOINT at a real OTLP/HTTP receiver in this process (tests/otlp_receiver.py,
  which decodes the protobuf), http/protobuf, the SDK's default batch processor settings (OTEL_BSP_*
  unset: 5 s schedule delay, batches of 512);
- file: `StackSpec.trace_file` (`pdserve up --trace-file`): spans appended to a JSON-lines file;
- off2: a second stack exactly like off, measured like the others: how far two identical stacks differ
  (an A/A control); an effect of tracing smaller than off2's distance from off is not resolved by this run.
The workload then runs in interleaved rounds (off, otlp, file, off2, off, otlp, ...), so drift and noise hit
every mode alike. A round: --requests streaming /v1/completions requests at --concurrency, each a distinct
--prompt-tokens-long list of token ids (the same prompts for every mode), max_tokens, ignore_eos, greedy.
Client side, per request: TTFT = request sent -> first SSE chunk carrying a token; e2e = sent -> [DONE];
per round: output throughput = completion tokens (from the usage chunk) / round wall time.

The batch processor exports every 5 s, so with rounds of a few seconds most exports happen after a round
ends. So that nothing lands in another mode's round, each round is followed by a settle period (--settle-s,
the same for every mode; longer for a traced mode until all of the round's spans have arrived), and the CPU
time (utime + stime from /proc) of the stack's gateway and workers is counted over round + settle: CPU per
request includes the export, wherever it fell. Spans received are checked: 9 per request for P/D
(gateway 2, prefill 4, decode 3); a mode that exported nothing would make the comparison meaningless.

Microbenchmark (in this process): `tracing.start_span` + `tracing.end_span` with tracing off (the global
no-op tracer: this process installs no provider) and on (an SDK TracerProvider with a BatchSpanProcessor
over an exporter that drops spans; `tracing.tracer` is pointed at its tracer for the measurement, the global
provider is left alone), `tracing.carrier()` inside a span, and encoding a finished span for export
(OTLP protobuf, JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere; tests.otlp_receiver lives in the repository

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from shared.telemetry.spanfile import read_spans  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

SPANS_PER_REQUEST = 9  # chat/text_completion, 2× publish, 2× process, prefill, pull_kv, send_kv, decode
SPAN_WAIT_S = 20.0  # a traced round's spans must arrive within settle + this
MODES = ("off", "otlp", "file", "off2")  # off2: a second stack exactly like off (A/A: stack-to-stack noise)


def prepare_model(model_dir: str | None, size: str) -> Path:
    if model_dir:
        return Path(model_dir)
    return ensure_demo_checkpoint(REPO / "models" / f"demo-{size}-qwen3_moe", size=size)


# ---- stacks -----------------------------------------------------------------------------------------------


class ModeStack:
    """One stack and how to count the spans it has exported so far."""

    def __init__(self, mode: str, model: Path, receiver: OtlpReceiver | None, trace_dir: Path) -> None:
        self.mode = mode
        self.trace_file = trace_dir / f"{mode}.jsonl" if mode == "file" else None
        env = {}
        if mode == "otlp":
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        spec = StackSpec(model=str(model), port=free_port(), threads_per_worker=1, env=env,
                         trace_file=str(self.trace_file) if self.trace_file else None)  # fmt: skip
        self.stack = Stack(spec)
        self.receiver = receiver
        self.requests_sent = 0  # including warm-up: every request is traced

    def start(self) -> ModeStack:
        try:
            self.stack.start(ready_timeout_s=300)
        except Exception:
            print(self.stack.logs(), file=sys.stderr)
            raise
        return self

    def spans(self) -> int | None:
        """Spans exported so far (None: this mode exports nothing)."""
        if self.mode == "otlp":
            return len(self.receiver.all_spans())
        if self.mode == "file":
            return sum(1 for _ in read_spans(self.trace_file)) if self.trace_file.exists() else 0
        return None

    def span_records(self) -> list[dict]:
        if self.mode == "otlp":
            return self.receiver.all_spans()
        if self.mode == "file" and self.trace_file.exists():
            return list(read_spans(self.trace_file))
        return []

    def cpu_s(self) -> dict[str, float]:
        """utime + stime of the gateway and each worker, seconds."""
        return {name: s for name, s in self.stack.cpu_seconds().items() if name in self.stack.procs}


# ---- client -----------------------------------------------------------------------------------------------

_local = threading.local()


def stream_completion(url: str, body: dict) -> dict:
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(timeout=120)
    t0 = time.perf_counter()
    first = None
    tokens = None
    request_id = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"request failed: {chunk['error']}")
            request_id = chunk.get("id", request_id)
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or tokens is None:
        raise RuntimeError(f"no token or no usage chunk in the stream of {request_id}")
    return {"ttft_ms": (first - t0) * 1000, "e2e_ms": (end - t0) * 1000, "tokens": tokens, "id": request_id}


def prompts(round_index: int, n: int, length: int) -> list[list[int]]:
    """Distinct token-id prompts per (round, request), identical across modes: no stack sees one twice."""
    rng = random.Random(1000 + round_index)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


def run_round(ms: ModeStack, pool: ThreadPoolExecutor, model_name: str, batch: list[list[int]], args) -> dict:
    bodies = [
        {"model": model_name, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}
        for p in batch
    ]  # fmt: skip
    url = ms.stack.url
    cpu0 = ms.cpu_s()
    t0 = time.perf_counter()
    results = list(pool.map(lambda b: stream_completion(url, b), bodies))
    wall = time.perf_counter() - t0
    ms.requests_sent += len(bodies)
    settle_until = time.monotonic() + args.settle_s
    span_deadline = settle_until + SPAN_WAIT_S
    while True:  # settle: the same for every mode; a traced mode also until its spans are all in
        now = time.monotonic()
        spans = ms.spans()
        arrived = spans is None or spans >= SPANS_PER_REQUEST * ms.requests_sent
        if now >= settle_until and (arrived or now >= span_deadline):
            break
        time.sleep(0.05)
    cpu1 = ms.cpu_s()
    tokens = sum(r["tokens"] for r in results)
    cpu = {name: cpu1[name] - cpu0[name] for name in cpu0}
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "ttft_ms": [r["ttft_ms"] for r in results],
        "e2e_ms": [r["e2e_ms"] for r in results],
        "cpu_s": cpu,
        "cpu_ms_per_request": sum(cpu.values()) * 1000 / len(results),
        "spans_total_after": spans,
    }


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[89]


def span_check(ms: ModeStack) -> dict | None:
    """Spans exported per request, and how many requests have a whole 9-span trace."""
    if ms.mode not in ("otlp", "file"):
        return None
    spans = ms.span_records()
    by_trace: dict[str, int] = {}
    for s in spans:
        by_trace[s["trace_id"]] = by_trace.get(s["trace_id"], 0) + 1
    return {
        "spans": len(spans),
        "requests": ms.requests_sent,
        "spans_per_request": len(spans) / ms.requests_sent,
        "complete_traces": sum(1 for n in by_trace.values() if n == SPANS_PER_REQUEST),
    }


# ---- in-process microbenchmark ----------------------------------------------------------------------------


def microbench(batches: int, per_batch: int) -> dict:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from shared.telemetry import tracing
    from shared.telemetry.spanfile import span_record

    class DropExporter(SpanExporter):
        def __init__(self) -> None:
            self.exported = 0
            self.last: list = []

        def export(self, spans) -> SpanExportResult:
            self.exported += len(spans)
            self.last = list(spans)
            return SpanExportResult.SUCCESS

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        raise RuntimeError("a global tracer provider is installed in this process; the 'off' case would not be off")
    attrs = {tracing.REQUEST_ID: "cmpl-0123456789abcdef", tracing.WORKER_ID: "prefill-0-12345",
             tracing.QUEUE_TIME: 0.0012, tracing.GEN_AI_USAGE_INPUT_TOKENS: 64}  # fmt: skip

    def per_span_us(fn) -> float:
        """Median over batches of µs per call; `flush` between batches runs outside the timed region."""
        times = []
        for _ in range(batches + 1):
            t0 = time.perf_counter_ns()
            for _ in range(per_batch):
                fn()
            times.append((time.perf_counter_ns() - t0) / per_batch / 1000)
            flush()
        return statistics.median(times[1:])  # the first batch warms up

    def span_pair() -> None:
        span = tracing.start_span("prefill demo", parent=parent_ctx, attributes=attrs)
        tracing.end_span(span)

    results = {}
    parent_ctx = None
    flush = lambda: None  # noqa: E731
    results["span_off_us"] = per_span_us(span_pair)
    results["carrier_off_us"] = per_span_us(tracing.carrier)
    assert tracing.carrier() == {}

    exporter = DropExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    flush = provider.force_flush  # the queue (2048) never fills, so no span is dropped unmeasured
    noop_tracer = tracing.tracer
    tracing.tracer = provider.get_tracer("pdserve")  # tracing.start_span uses this module attribute
    try:
        root = tracing.tracer.start_span("chat demo")
        parent_ctx = trace.set_span_in_context(root)
        results["span_on_us"] = per_span_us(span_pair)
        finished = exporter.last[-1:] * 100  # 100 finished "prefill" spans, as the batch processor hands them over
        with tracing.use_span(root, end_on_exit=True):
            results["carrier_on_us"] = per_span_us(tracing.carrier)
            assert "traceparent" in tracing.carrier()
    finally:
        tracing.tracer = noop_tracer
        provider.shutdown()
    results["spans_exported_by_sdk"] = exporter.exported
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    def per_encoded_span_us(encode) -> float:
        times = []
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            encode(finished)
            times.append((time.perf_counter_ns() - t0) / len(finished) / 1000)
        return statistics.median(times)

    # what each exporter does per span in the batch processor's thread (before the write / HTTP POST)
    results["encode_otlp_us"] = per_encoded_span_us(lambda spans: encode_spans(spans).SerializeToString())
    results["encode_jsonl_us"] = per_encoded_span_us(
        lambda spans: "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
    )
    return results


# ---- main -------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the qwen3_moe demo of --size, written once)")
    ap.add_argument("--size", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="per round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8, help="requests per stack before the first round")
    ap.add_argument("--settle-s", type=float, default=5.5, help="idle after every round (default BSP delay: 5 s)")
    ap.add_argument("--micro-batches", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tracing_overhead.json"))
    args = ap.parse_args()
    if "off" not in args.modes:
        raise SystemExit("--modes must include off (the baseline)")
    dropped = sorted(k for k in os.environ if k.startswith("OTEL_"))
    for k in dropped:  # the launcher passes this environment on: 'off' must have no OTEL_* at all
        del os.environ[k]
    if dropped:
        print(f"ignoring {', '.join(dropped)} from the environment", flush=True)
    model = prepare_model(args.model, args.size)
    t_start = time.monotonic()

    print("microbenchmark (in process) ...", flush=True)
    micro = microbench(args.micro_batches, 500)

    trace_dir = Path(tempfile.mkdtemp(prefix="pdserve-trace-bench-"))
    with OtlpReceiver() as receiver:
        stacks = {m: ModeStack(m, model, receiver, trace_dir) for m in args.modes}
        print(f"starting {len(stacks)} stacks ({', '.join(stacks)}) ...", flush=True)
        try:
            with ThreadPoolExecutor(len(stacks)) as starter:
                list(starter.map(ModeStack.start, stacks.values()))
            rounds: dict[str, list[dict]] = {m: [] for m in stacks}
            with ThreadPoolExecutor(args.concurrency) as pool:
                for ms in stacks.values():  # warm-up: not measured, but traced (counted in requests_sent)
                    run_round(ms, pool, model.name, prompts(-1, args.warmup, args.prompt_tokens), args)
                for r in range(args.rounds):
                    batch = prompts(r, args.requests, args.prompt_tokens)
                    for mode, ms in stacks.items():
                        rounds[mode].append(run_round(ms, pool, model.name, batch, args))
                        last = rounds[mode][-1]
                        print(f"round {r + 1}/{args.rounds} {mode:<5} {last['throughput_tok_s']:7.1f} tok/s  TTFT "
                              f"p50 {statistics.median(last['ttft_ms']):6.1f} ms  CPU "
                              f"{last['cpu_ms_per_request']:5.1f} ms/req", flush=True)  # fmt: skip
            spans = {m: span_check(ms) for m, ms in stacks.items()}
        finally:
            for ms in stacks.values():
                ms.stack.stop()

    summary = {}
    for mode, rs in rounds.items():
        ttft = [t for r in rs for t in r["ttft_ms"]]
        e2e = [t for r in rs for t in r["e2e_ms"]]
        tput = [r["throughput_tok_s"] for r in rs]
        summary[mode] = {
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": p90(ttft),
            "e2e_p50_ms": statistics.median(e2e),
            "throughput_median_tok_s": statistics.median(tput),
            "throughput_min_tok_s": min(tput),
            "throughput_max_tok_s": max(tput),
            "cpu_ms_per_request_median": statistics.median(r["cpu_ms_per_request"] for r in rs),
        }
    base = summary["off"]
    for mode, s in summary.items():
        s["ttft_p50_ratio"] = s["ttft_p50_ms"] / base["ttft_p50_ms"]
        s["throughput_ratio"] = s["throughput_median_tok_s"] / base["throughput_median_tok_s"]
        s["cpu_ratio"] = s["cpu_ms_per_request_median"] / base["cpu_ms_per_request_median"]
        # paired: each round against the same round's 'off', then the median over rounds
        pairs = list(zip(rounds[mode], rounds["off"], strict=True))
        tput_ratios = [a["throughput_tok_s"] / b["throughput_tok_s"] for a, b in pairs]
        s["paired_throughput_ratio"] = statistics.median(tput_ratios)
        s["paired_ttft_p50_ratio"] = statistics.median(
            statistics.median(a["ttft_ms"]) / statistics.median(b["ttft_ms"]) for a, b in pairs
        )

    print(
        f"\nmodel {model.name}, 1 prefill + 1 decode, {args.rounds} rounds × {args.requests} requests at "
        f"concurrency {args.concurrency}, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens out"
    )
    cols = [("mode", 6), ("TTFT p50", 10), ("p90", 8), ("e2e p50", 9), ("tok/s", 8), ("(min-max)", 13),
            ("CPU ms/req", 11), ("TTFT ×", 8), ("tok/s ×", 9), ("CPU ×", 7), ("paired TTFT ×", 14),
            ("paired tok/s ×", 15), ("spans/req", 11)]  # fmt: skip
    print(cols[0][0].ljust(cols[0][1]) + "".join(name.rjust(width) for name, width in cols[1:]))
    for mode, s in summary.items():
        check = spans[mode]
        cells = [
            f"{s['ttft_p50_ms']:.2f}",
            f"{s['ttft_p90_ms']:.2f}",
            f"{s['e2e_p50_ms']:.1f}",
            f"{s['throughput_median_tok_s']:.1f}",
            f"({s['throughput_min_tok_s']:.0f}-{s['throughput_max_tok_s']:.0f})",
            f"{s['cpu_ms_per_request_median']:.2f}",
            f"{s['ttft_p50_ratio']:.3f}",
            f"{s['throughput_ratio']:.3f}",
            f"{s['cpu_ratio']:.3f}",
            f"{s['paired_ttft_p50_ratio']:.3f}",
            f"{s['paired_throughput_ratio']:.3f}",
            f"{check['spans_per_request']:.2f}" if check else "-",
        ]
        print(mode.ljust(cols[0][1]) + "".join(c.rjust(width) for c, (_, width) in zip(cells, cols[1:], strict=True)))
    for mode, check in spans.items():
        if check and check["complete_traces"] != check["requests"]:
            print(
                f"WARNING: {mode}: {check['complete_traces']} of {check['requests']} requests have all "
                f"{SPANS_PER_REQUEST} spans ({check['spans']} spans)",
                file=sys.stderr,
            )
    m = micro
    print("\nin process, µs per call (median of batches of 500):")
    print(f"  start_span + end_span  off {m['span_off_us']:.2f}   on (SDK, batch processor) {m['span_on_us']:.2f}")
    print(f"  carrier()              off {m['carrier_off_us']:.2f}   on {m['carrier_on_us']:.2f}")
    print(f"  encode a finished span: OTLP protobuf {m['encode_otlp_us']:.2f}, JSON line {m['encode_jsonl_us']:.2f}")
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {
        "model": model.name,
        "prefill": 1,
        "decode": 1,
        "threads_per_worker": 1,
        "cpus": os.cpu_count(),
    }
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    report = {"timestamp": stamp, "config": config, "summary": summary, "spans": spans, "rounds": rounds,
              "microbench_us": micro}  # fmt: skip
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
