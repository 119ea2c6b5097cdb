"""Cross-check `pdserve bench` against an external load tool users already trust (NVIDIA AIPerf): the same
configuration, alternately, against one pdserve stack, and whether TTFT / ITL agree within the run-to-run noise.

    .venv/bin/python benchmarks/crosscheck_external.py [--aiperf PATH] [--size small] [--rounds 3]
        [--num-prompts 64] [--concurrency 4] [--input-len 128] [--output-len 64]

AIPerf lives in a virtualenv of its own, never in the project's (it brings a heavy dependency tree):

    python3 -m venv /work/tools/aiperf && /work/tools/aiperf/bin/pip install aiperf==0.13.0

One stack (1 prefill + 1 decode, a demo checkpoint), then per round: AIPerf, then `pdserve bench`, with the same
endpoint (/v1/completions), streaming, closed-loop concurrency, input/output lengths (ignore_eos, greedy) and request
count; round r uses seed r in both tools. Results: benchmarks/results/crosscheck_external.json and a table.

The two tools do not define every metric alike (docs/bench.md, "Cross-check with an external client"):
- AIPerf counts a chunk only when its text is non-empty. pdserve streams one chunk per token and a byte-level
  token that ends inside a UTF-8 character releases no text, so AIPerf's TTFT is to the first chunk *with text*,
  its inter-chunk latency (ICL) merges the gaps around empty chunks, and its request latency ends at the last chunk
  with text. pdserve bench (as vLLM) counts every chunk with a choice.
- AIPerf's "ITL" is per request (latency − TTFT) / (tokens − 1): what pdserve bench (as vLLM) calls TPOT. pdserve
  bench's ITL is every gap between token chunks, pooled over requests: AIPerf's ICL, modulo the point above.
- Output tokens: AIPerf tokenizes the text client-side unless --use-server-token-count (passed here); pdserve bench
  reads the usage chunk. Both then count the server's completion_tokens.
To compare timings without the definitions in the way, every AIPerf run is also recomputed from its own raw export
(profile_export_raw.jsonl: every SSE event with AIPerf's receive timestamp) with pdserve bench's definitions and
statistics code (services.bench.metrics.summarize): rows "aiperf→pd".

A load generator also loads the machine: on a small host its own CPU use slows the server it measures (AIPerf's
several processes use far more CPU than pdserve bench's one). So the stack writes a span file, and each run is also
read from the gateway's side: its own TTFT / TPOT for the same measured requests (rows "gateway"). The gateway ratio
(pdserve bench's runs / AIPerf's) is how differently the server itself ran; the client ratio divided by it is what
the two tools disagree on as measuring instruments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from services.bench.metrics import RequestRecord, summarize
from services.demo_model import ensure_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_AIPERF = "/work/tools/aiperf/bin/aiperf"
PERCENTILES = (50, 90, 99)
# Columns of the table: (key in a run's metrics, header).
COLUMNS = [(f"{m}_p{p}", f"{m.upper()} p{p}") for m in ("ttft", "itl") for p in PERCENTILES] + [
    ("tpot_p50", "TPOT p50"),
    ("out_tok_s", "out tok/s"),
]
GATEWAY_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "e2el_p50", "prefill_p50",
                "client_minus_gateway_ttft_p50")  # fmt: skip
RUN_TIMEOUT_S = 600
SPAN_FLUSH_S = 6.0  # the span file's batch processor writes every 5 s; the gateway's last spans need that long


def aiperf_command(aiperf: str, url: str, model: str, tokenizer_dir: Path, args, seed: int, out_dir: Path) -> list:
    return [
        aiperf, "profile",
        "--model", model,
        "--url", url,
        "--endpoint-type", "completions",
        "--streaming",
        "--tokenizer", str(tokenizer_dir),
        "--isl", str(args.input_len), "--isl-stddev", "0",
        "--osl", str(args.output_len), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "temperature:0",
        "--concurrency", str(args.concurrency),
        "--request-count", str(args.num_prompts),
        "--warmup-request-count", str(args.warmups),
        "--use-server-token-count",
        "--random-seed", str(seed),
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--export-level", "raw",
        "--artifact-dir", str(out_dir),
    ]  # fmt: skip


def bench_prefix() -> list[str]:
    """`pdserve bench` through the top-level CLI when it registers the command, else its module alone."""
    cli = (REPO / "services" / "cli.py").read_text()
    if "add_bench_command" in cli:
        return [sys.executable, "-m", "services.cli", "bench"]
    return [sys.executable, "-m", "services.bench.cli"]


def bench_command(url: str, model: str, tokenizer_dir: Path, args, seed: int, result_file: Path) -> list[str]:
    return [
        *bench_prefix(),
        "--base-url", url,
        "--model", model,
        "--tokenizer", str(tokenizer_dir),
        "--endpoint", "completions",
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--seed", str(seed),
        "--num-warmups", str(args.warmups),
        "--disable-tqdm",
        "--result-file", str(result_file),
        "--save-detailed",
    ]  # fmt: skip


def run_timed(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run a client to completion; wall time, its CPU time (user + sys of it and its children) and load."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    wall_ns = time.time_ns()
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "client_cpu_s": cpu, "loadavg_1m_before": load, "loadavg_1m_after": os.getloadavg()[0],
            "window_ns": [wall_ns, time.time_ns()]}  # fmt: skip


def _pcts(stat: dict, name: str, scale: float = 1.0) -> dict:
    return {f"{name}_p{p}": stat[f"p{p}"] * scale for p in PERCENTILES}


def row(s: dict, duration_s: float) -> dict:
    """One tool's numbers from a summary with vLLM's keys (`vllm bench serve` / `pdserve bench` result)."""
    out = {"completed": s["completed"], "failed": s["failed"], "duration_s": duration_s}
    for name in ("ttft", "itl", "tpot", "e2el"):
        for p in PERCENTILES:
            out[f"{name}_p{p}"] = s[f"p{p}_{name}_ms"]
    out["out_tok_s"] = s["output_throughput"]
    out["mean_output_tokens"] = s["total_output_tokens"] / max(1, s["completed"])
    out["mean_prompt_tokens"] = s["total_input_tokens"] / max(1, s["completed"])
    out["in_flight"] = s["mean_e2el_ms"] / 1000.0 * s["completed"] / duration_s  # mean requests in flight
    return out


def parse_bench(result_file: Path) -> dict:
    s = json.loads(result_file.read_text())
    out = row(s, s["duration"])
    # (send time, TTFT) of each completed request in send order, to pair with the gateway's spans.
    sent = [(t, ttft) for t, ttft, err in zip(s["start_times"], s["ttfts"], s["errors"], strict=True) if not err]
    out["client_sends"] = sorted(sent)
    return out


def parse_aiperf_native(out_dir: Path) -> dict:
    """AIPerf's own summary (profile_export_aiperf.json), under this script's names: itl is its inter-chunk latency
    (pooled gaps, the vLLM-ITL analogue), tpot its "inter_token_latency" (per-request (latency − TTFT)/(OSL − 1))."""
    d = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    out = {
        "completed": int(d["request_count"]["avg"]),
        "failed": int(d.get("error_request_count", {}).get("avg", 0)),
        "duration_s": d["benchmark_duration"]["avg"],
    }
    out |= _pcts(d["time_to_first_token"], "ttft")
    out |= _pcts(d["inter_chunk_latency"], "itl")
    out |= _pcts(d["inter_token_latency"], "tpot")
    out |= _pcts(d["request_latency"], "e2el")
    out["out_tok_s"] = d["output_token_throughput"]["avg"]
    out["mean_output_tokens"] = d["output_sequence_length"]["avg"]
    out["mean_prompt_tokens"] = d["input_sequence_length"]["avg"]
    out["in_flight"] = d["effective_concurrency"]["avg"]
    return out


def _events(record: dict) -> list[tuple[int, str]]:
    return [(r["perf_ns"], p["value"]) for r in record["responses"] for p in r["packets"] if p.get("name") == "data"]


def aiperf_raw_records(out_dir: Path) -> tuple[list[RequestRecord], dict]:
    """AIPerf's raw export as pdserve bench's RequestRecords (TTFT to the first chunk with a choice, ITL every gap
    between such chunks, latency to [DONE], output tokens from usage), and counts behind the definitional notes."""
    lines = (out_dir / "profile_export_raw.jsonl").read_text().splitlines()
    raws = [r for r in map(json.loads, filter(None, lines)) if r["metadata"].get("benchmark_phase") == "profiling"]
    t0 = min(r["start_perf_ns"] for r in raws)
    end = t0
    records, facts = [], {"token_chunks": 0, "empty_text_chunks": 0, "first_chunk_empty": 0, "same_read_gaps": 0}
    texts, client_ttft = [], {}
    for raw in raws:
        start = raw["start_perf_ns"]
        rec = RequestRecord("default", 0, 0, start_s=(start - t0) / 1e9, success=False)
        chunk_ns, text = [], []
        done = response_id = None
        for ns, value in _events(raw):
            if value == "[DONE]":
                done = ns
                continue
            event = json.loads(value)
            response_id = response_id or event.get("id")
            if event.get("choices"):
                piece = event["choices"][0].get("text") or ""
                facts["empty_text_chunks"] += not piece
                if not chunk_ns:
                    facts["first_chunk_empty"] += not piece
                chunk_ns.append(ns)
                text.append(piece)
            if isinstance(event.get("usage"), dict):
                rec.output_tokens = event["usage"].get("completion_tokens", 0)
                rec.prompt_len = event["usage"].get("prompt_tokens", 0)
        facts["token_chunks"] += len(chunk_ns)
        if raw.get("status") == 200 and chunk_ns and done is not None:
            rec.success = True
            rec.ttft_s = (chunk_ns[0] - start) / 1e9
            rec.itl_s = [(b - a) / 1e9 for a, b in zip(chunk_ns, chunk_ns[1:], strict=False)]
            rec.latency_s = (done - start) / 1e9
            end = max(end, done)
            facts["same_read_gaps"] += sum(1 for g in rec.itl_s if g == 0.0)
            texts.append("".join(text))
            client_ttft[response_id] = rec.ttft_s
        records.append(rec)
    facts["requests"] = len(raws)
    facts["texts"] = texts
    facts["client_ttft_s"] = client_ttft  # response id → TTFT (first chunk with a choice), to match gateway spans
    facts["duration_s"] = (end - t0) / 1e9  # first send → last [DONE], as pdserve bench times a run
    return records, facts


def parse_aiperf_recomputed(out_dir: Path, tokenizer: Tokenizer) -> tuple[dict, dict]:
    records, facts = aiperf_raw_records(out_dir)
    duration_s = facts["duration_s"]
    s = summarize(records, duration_s, percentiles=PERCENTILES)
    out = row(s, duration_s)
    # What AIPerf would count as output tokens without --use-server-token-count: its tokenizer over the text.
    texts = facts.pop("texts")
    out["client_ttft_s"] = facts.pop("client_ttft_s")
    facts["mean_client_tokenized_output_tokens"] = statistics.fmean(len(tokenizer.encode(t)) for t in texts)
    return out, facts


def gateway_spans(trace_file: Path) -> list[dict]:
    """The gateway's request spans from the stack's span file: start (ns, wall clock), response id, and the
    gateway's own TTFT / TPOT / e2e (handler took the request → token handed to the client; e2e to the last
    token), in seconds; plus prefill_s, the prefill worker's compute span for the same request."""
    spans, prefill = [], {}
    for line in trace_file.read_text().splitlines():
        span = json.loads(line)
        attrs = span["attributes"]
        if span["service"] == "pdserve-prefill" and span["name"].startswith("prefill "):
            prefill[attrs["pdserve.request_id"]] = (span["end_ns"] - span["start_ns"]) / 1e9
        if span["service"] == "pdserve-gateway" and span["kind"] == "SERVER" and "pdserve.e2e_s" in attrs:
            spans.append({"start_ns": span["start_ns"], "id": attrs["pdserve.request_id"],
                          "ttft_s": attrs["gen_ai.server.time_to_first_token"],
                          "tpot_s": attrs.get("gen_ai.server.time_per_output_token", 0.0),
                          "e2e_s": attrs["pdserve.e2e_s"]})  # fmt: skip
    for span in spans:
        span["prefill_s"] = prefill.get(span["id"], 0.0)
    return sorted(spans, key=lambda s: s["start_ns"])


def pair_by_send_order(sends: list[tuple[float, float]], spans: list[dict]) -> dict[str, float] | None:
    """pdserve bench's result has no response ids: pair its requests with the gateway's spans in send order
    (response id → client TTFT). None when the pairing is not trustworthy: counts differ, or the clock offset
    between a send and its span's start wanders by more than 20 ms."""
    if len(sends) != len(spans):
        return None
    offsets = [sp["start_ns"] / 1e9 - t for (t, _), sp in zip(sends, spans, strict=True)]
    mid = statistics.median(offsets)
    if max(abs(o - mid) for o in offsets) > 0.020:
        return None
    return {sp["id"]: ttft for (_, ttft), sp in zip(sends, spans, strict=True)}


def gateway_view(run: dict, spans: list[dict], warmups: int) -> dict:
    """The gateway's own measurements of the run's measured requests: spans inside the run's wall-clock window,
    AIPerf's matched by response id (its profiling phase), pdserve bench's without the first `warmups` (sent one
    at a time before its clock starts) and paired in send order. client_minus_gateway_ttft_p50: the median over
    requests of client TTFT − gateway TTFT, what the client adds (connection, HTTP, SSE, its own scheduling);
    p50 minus p50 where requests could not be paired."""
    lo, hi = run["window_ns"]
    inside = [s for s in spans if lo <= s["start_ns"] <= hi]
    client = run["pd_definitions"].get("client_ttft_s")
    if client is not None:
        mine = [s for s in inside if s["id"] in client]
    else:
        mine = inside[warmups:]
        client = pair_by_send_order(run["pd_definitions"]["client_sends"], mine)

    def ms(values: list[float], p: float) -> float:
        return float(np.percentile(np.asarray(values) * 1000.0, p))

    out = {"requests": len(mine), "paired_per_request": client is not None}
    out |= {f"ttft_p{p}": ms([s["ttft_s"] for s in mine], p) for p in PERCENTILES}
    out |= {"tpot_p50": ms([s["tpot_s"] for s in mine], 50), "e2el_p50": ms([s["e2e_s"] for s in mine], 50)}
    out["prefill_p50"] = ms([s["prefill_s"] for s in mine], 50)
    if client is not None:
        out["client_minus_gateway_ttft_p50"] = ms([client[s["id"]] - s["ttft_s"] for s in mine], 50)
    else:
        out["client_minus_gateway_ttft_p50"] = run["pd_definitions"]["ttft_p50"] - out["ttft_p50"]
    return out


def warm_up(url: str, model: str, n: int = 4) -> None:
    """A few streamed requests, one at a time, measured by neither tool."""
    body = {"model": model, "prompt": "warm up " * 16, "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        for _ in range(n):
            with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                for _line in resp.iter_lines():
                    pass


def median_row(rows: list[dict], keys=None) -> dict:
    keys = keys or [k for k, _ in COLUMNS]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def spread(rows: list[dict]) -> dict:
    """(max − min) / median over rounds, per column: the round-to-round noise of one tool."""
    out = {}
    for k, _ in COLUMNS:
        values = [r[k] for r in rows]
        med = statistics.median(values)
        out[k] = (max(values) - min(values)) / med if med else 0.0
    return out


def analyse(runs: list[dict]) -> dict:
    """Medians per tool, ratios pdserve bench / AIPerf (same definitions, and AIPerf's own), the noise (largest
    round-to-round spread of either tool, same definitions) and whether each ratio is within it."""
    pd = [r["pd_definitions"] for r in runs if r["tool"] == "pdserve bench"]
    ext = [r for r in runs if r["tool"] == "aiperf"]
    ext_pd = [r["pd_definitions"] for r in ext]
    med = {
        "pdserve bench": median_row(pd),
        "aiperf (native)": median_row([r["native"] for r in ext]),
        "aiperf→pd": median_row(ext_pd),
    }
    ratio_same = {k: med["pdserve bench"][k] / med["aiperf→pd"][k] for k, _ in COLUMNS}
    ratio_native = {k: med["pdserve bench"][k] / med["aiperf (native)"][k] for k, _ in COLUMNS}
    spread_pd, spread_ext = spread(pd), spread(ext_pd)
    noise = {k: max(spread_pd[k], spread_ext[k]) for k, _ in COLUMNS}
    gw = {tool: median_row([r["gateway"] for r in runs if r["tool"] == tool], GATEWAY_KEYS)
          for tool in ("pdserve bench", "aiperf")}  # fmt: skip
    ratio_gw = {k: gw["pdserve bench"][k] / gw["aiperf"][k] for k in GATEWAY_KEYS if gw["aiperf"][k]}
    facts = [r["facts"] for r in ext]
    chunks = sum(f["token_chunks"] for f in facts)
    requests = sum(f["requests"] for f in facts)
    return {
        "medians": med,
        "ratio_pdserve_over_aiperf_same_definitions": ratio_same,
        "ratio_pdserve_over_aiperf_native": ratio_native,
        "noise_max_round_spread": noise,
        "agree_within_noise": {k: abs(ratio_same[k] - 1) <= noise[k] for k, _ in COLUMNS},
        "gateway_medians": gw,
        # How much the server itself differed between the two tools' runs, by its own clock.
        "ratio_gateway_pdserve_runs_over_aiperf_runs": ratio_gw,
        # The client-side ratio with the server's own difference taken out: 1 = the tools measure alike.
        "ratio_same_definitions_over_gateway_ratio": {
            k: ratio_same[k] / ratio_gw[k] for k, _ in COLUMNS if k in ratio_gw
        },
        "facts": {
            "empty_text_chunk_fraction": sum(f["empty_text_chunks"] for f in facts) / chunks,
            "first_chunk_empty_fraction": sum(f["first_chunk_empty"] for f in facts) / requests,
            "zero_gap_fraction": sum(f["same_read_gaps"] for f in facts) / max(1, chunks - requests),
            "mean_client_tokenized_output_tokens": statistics.fmean(
                f["mean_client_tokenized_output_tokens"] for f in facts
            ),
            "client_cpu_s_per_run": {
                tool: statistics.fmean(r["client_cpu_s"] for r in runs if r["tool"] == tool)
                for tool in ("aiperf", "pdserve bench")
            },
        },
    }


def fmt_row(label: str, row: dict, digits: int = 1) -> str:
    return f"{label:<24}" + "".join(f"{row[k]:>10.{digits}f}" if k in row else f"{'-':>10}" for k, _ in COLUMNS)


def report(runs: list[dict], result: dict, args, model_name: str) -> None:
    print(f"\n{args.num_prompts} requests, concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out "
          f"(ignore_eos), /v1/completions streamed, {model_name}, 1 prefill + 1 decode; ms, tok/s")  # fmt: skip
    print(f"{'':<24}" + "".join(f"{h:>10}" for _, h in COLUMNS))
    for r in runs:
        if r["tool"] == "aiperf":
            print(fmt_row(f"r{r['round']} aiperf (native)", r["native"]))
            print(fmt_row(f"r{r['round']} aiperf→pd", r["pd_definitions"]))
        else:
            print(fmt_row(f"r{r['round']} pdserve bench", r["pd_definitions"]))
        print(fmt_row("  gateway, same requests", r["gateway"]))
    for label, row in result["medians"].items():
        print(fmt_row(f"median {label}", row))
    for tool, row in result["gateway_medians"].items():
        print(fmt_row(f"median gateway ({tool.split()[0]})", row))
    print(fmt_row("pdserve / aiperf→pd", result["ratio_pdserve_over_aiperf_same_definitions"], 3))
    print(fmt_row("pdserve / aiperf native", result["ratio_pdserve_over_aiperf_native"], 3))
    print(fmt_row("gateway pdserve/aiperf", result["ratio_gateway_pdserve_runs_over_aiperf_runs"], 3))
    print(fmt_row("client ratio ÷ gateway's", result["ratio_same_definitions_over_gateway_ratio"], 3))
    print(fmt_row("noise (max round spread)", result["noise_max_round_spread"], 3))
    agree = result["agree_within_noise"]
    print(f"{'within noise':<24}" + "".join(f"{'yes' if agree[k] else 'NO':>10}" for k, _ in COLUMNS))
    f = result["facts"]
    print(f"\nAIPerf raw: {f['empty_text_chunk_fraction']:.0%} of token chunks have empty text; "
          f"{f['first_chunk_empty_fraction']:.0%} of requests start with one; {f['zero_gap_fraction']:.0%} of gaps "
          f"are 0 (events read together); its tokenizer would count {f['mean_client_tokenized_output_tokens']:.1f} "
          f"output tokens vs {args.output_len} by usage")  # fmt: skip
    cpu = f["client_cpu_s_per_run"]
    print(f"client CPU per run: aiperf {cpu['aiperf']:.1f} s, pdserve bench {cpu['pdserve bench']:.1f} s")
    offset = {t: row["client_minus_gateway_ttft_p50"] for t, row in result["gateway_medians"].items()}
    inflight = {t: statistics.median(r["pd_definitions"]["in_flight"] for r in runs if r["tool"] == t) for t in offset}
    print(f"client TTFT − gateway TTFT (p50, ms): aiperf {offset['aiperf']:.1f}, pdserve bench "
          f"{offset['pdserve bench']:.1f}; requests in flight (median): aiperf {inflight['aiperf']:.2f}, "
          f"pdserve bench {inflight['pdserve bench']:.2f}")  # fmt: skip
    gw = result["gateway_medians"]
    print(f"prefill worker's compute per request (p50, ms): during aiperf runs {gw['aiperf']['prefill_p50']:.1f}, "
          f"during pdserve bench runs {gw['pdserve bench']['prefill_p50']:.1f}")  # fmt: skip


def run_rounds(args, url: str, model: Path, tokenizer: Tokenizer, artifacts: Path, aiperf_env: dict) -> list[dict]:
    runs = []
    for r in range(1, args.rounds + 1):
        out_dir = artifacts / f"aiperf_round{r}"
        cmd = aiperf_command(args.aiperf, url, model.name, model, args, r, out_dir)
        meta = run_timed(cmd, artifacts / f"aiperf_round{r}.log", env=aiperf_env)
        native = parse_aiperf_native(out_dir)
        recomputed, facts = parse_aiperf_recomputed(out_dir, tokenizer)
        runs.append({"round": r, "tool": "aiperf", "command": shlex.join(cmd), **meta, "native": native,
                     "pd_definitions": recomputed, "facts": facts})  # fmt: skip
        print(fmt_row(f"r{r} aiperf→pd", recomputed), flush=True)

        result_file = artifacts / f"pdserve_bench_round{r}.json"
        cmd = bench_command(url, model.name, model, args, r, result_file)
        meta = run_timed(cmd, artifacts / f"pdserve_bench_round{r}.log")
        runs.append({"round": r, "tool": "pdserve bench", "command": shlex.join(cmd), **meta,
                     "pd_definitions": parse_bench(result_file)})  # fmt: skip
        print(fmt_row(f"r{r} pdserve bench", runs[-1]["pd_definitions"]), flush=True)
    return runs


DEFINITIONS = {
    "pd_definitions": "pdserve bench (as vLLM): TTFT to the first chunk with a choice; ITL every gap between such "
    "chunks, pooled; TPOT (latency to [DONE] - TTFT) / (tokens - 1) per request; tokens from usage",
    "aiperf native": "TTFT to the first chunk with non-empty text; itl = AIPerf inter_chunk_latency (gaps between "
    "chunks with text, pooled); tpot = AIPerf inter_token_latency ((last text chunk - TTFT) / (OSL - 1)); OSL from "
    "usage (--use-server-token-count)",
    "aiperf→pd": "AIPerf's raw export (its own receive timestamps) recomputed with services.bench.metrics.summarize",
    "gateway": "the gateway's request span (span file) for the same measured requests: TTFT handler took the "
    "request → first token handed to the client; TPOT (last - first token) / (tokens - 1); e2e to the last token",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", default=DEFAULT_AIPERF, help="the aiperf executable (its own virtualenv)")
    ap.add_argument("--model", help="checkpoint (default: the qwen3_moe demo of --size, written once)")
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warmups", type=int, default=4, help="unmeasured requests each tool sends first (AIPerf: at "
                    "the run's concurrency; pdserve bench: one at a time)")  # fmt: skip
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "crosscheck_external.json"))
    ap.add_argument("--artifacts", default=str(REPO / "benchmarks" / "results" / "crosscheck_external"),
                    help="per-run AIPerf artifact folders, pdserve bench result files and client logs")  # fmt: skip
    args = ap.parse_args()
    if not Path(args.aiperf).is_file():
        sys.exit(f"no aiperf at {args.aiperf}: python3 -m venv /work/tools/aiperf && "
                 "/work/tools/aiperf/bin/pip install aiperf==0.13.0, or pass --aiperf PATH")  # fmt: skip
    model = Path(args.model or REPO / "models" / f"demo-{args.size}-qwen3_moe")
    ensure_demo_checkpoint(model, size=args.size)
    artifacts = Path(args.artifacts)
    artifacts.mkdir(parents=True, exist_ok=True)
    aiperf_version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    # AIPerf 0.13.0 cannot load a local tokenizer directory under HF_HUB_OFFLINE=1 (it sends the path through
    # huggingface_hub.snapshot_download); a local path never reaches the Hub, so the variable is simply dropped.
    aiperf_env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}

    t_start = time.perf_counter()
    trace_file = artifacts / "spans.jsonl"  # the gateway's own TTFT/TPOT per request (about 1% overhead)
    trace_file.unlink(missing_ok=True)
    spec = StackSpec(model=str(model), port=free_port(), prefill=1, decode=1, threads_per_worker=1,
                     trace_file=str(trace_file))  # fmt: skip
    stack = Stack(spec)
    stack.start(ready_timeout_s=180)
    try:
        warm_up(stack.url, model.name)
        runs = run_rounds(args, stack.url, model, Tokenizer(model), artifacts, aiperf_env)
        time.sleep(SPAN_FLUSH_S)
    finally:
        stack.stop()
    total_s = time.perf_counter() - t_start
    spans = gateway_spans(trace_file)
    for run in runs:
        run["gateway"] = gateway_view(run, spans, args.warmups)
        run["pd_definitions"].pop("client_ttft_s", None)
        run["pd_definitions"].pop("client_sends", None)
    result = analyse(runs)
    report(runs, result, args, model.name)
    print(f"total {total_s:.0f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "external_tool": {"name": "NVIDIA AIPerf", "package": "aiperf", "version": aiperf_version,
                          "executable": args.aiperf, "command_round1": runs[0]["command"]},
        "config": {"model": model.name, "topology": "1 prefill + 1 decode", "endpoint": "/v1/completions",
                   "stream": True, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                   "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                   "temperature": 0, "warmups": args.warmups, "rounds": args.rounds,
                   "order": "aiperf, then pdserve bench, in every round; round r uses seed r in both"},
        "columns": dict(COLUMNS),
        "definitions": DEFINITIONS,
        "runs": runs,
        **result,
        "total_runtime_s": total_s,
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
