"""Colocated vs disaggregated serving on the same cores, the same model and the same workload, in one run.

    .venv/bin/python benchmarks/compare_pd.py [--quick] [--rates 0.5,1,1.5,2] [--duration 60] [--out DIR]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--chunk-budget 512] [--no-find-knee] [--knee-factor 1.5]
        [--max-rate 16] [--modes colocated,colocated-chunked,disaggregated,disaggregated-auto]
    .venv/bin/python benchmarks/compare_pd.py --replot benchmarks/results/compare_pd/compare_pd.json

The claim under test: separating prefill from decode removes their interference. A long prompt no longer stalls
every running request's token stream, so TPOT stays flat and goodput under latency SLOs rises, at the price of
moving the KV cache (and, here, of splitting two cores one per phase instead of sharing both).

Modes (real stacks started by `pdserve up`'s launcher: nats-server, redis-server, gateway, workers as processes):
- colocated: one mixed worker, chunked prefill off (max_num_batched_tokens = the model's context length, so a
  whole prompt runs in one step, as a classic colocated server does: a long prompt stalls every decode for that
  step), 2 torch threads, pinned to both cores (--cores, default 0,1);
- colocated-chunked: one mixed worker, chunked prefill on (--chunk-budget tokens per step, default 512, the
  worker's default), 2 threads, both cores;
- disaggregated: one prefill worker (1 thread, first core) + one decode worker (1 thread, second core); the gateway
  sends every prompt through the prefill worker (PDSERVE_PREFILL_PATH=remote);
- disaggregated-auto: the same workers, the gateway choosing the path per request (PDSERVE_PREFILL_PATH=auto): a
  prompt may be prefilled on the decode worker itself ("local", no KV hand-off) when that is cheaper; its cost
  model gets this run's SLOs (PDSERVE_TTFT_SLO_MS, PDSERVE_TPOT_SLO_MS).
Workers are pinned with StackSpec.cpu_affinity (checked afterwards on every thread of every worker); the gateway,
nats-server, redis-server and this process (the load generator) are not pinned: they float over both cores in
every mode alike. All stacks are started up front when memory allows (else one at a time).

Workload (services.bench.datasets.interference_requests, the same requests for every mode at a given rate):
"stream" requests (--stream-input-len tokens in, --stream-output-len out, Poisson arrivals at the stream rate)
plus a "long" prompt (--long-input-len in, --long-output-len out) every --long-interval seconds, for --duration
seconds; every request is greedy, streamed, ignore_eos. For each rate, the modes run one after the other in an
order rotated per rate, each after a short warm-up (a long and a few stream requests, not recorded). Metrics
come from services.bench (vLLM's definitions, client side): TTFT, TPOT = (E2EL - TTFT)/(tokens - 1), ITL = every
gap between token chunks; goodput = completed requests meeting both SLOs (TTFT <= --slo-ttft-ms and TPOT <=
--slo-tpot-ms), per second of run (first send to last [DONE]).

Before the runs each mode is probed unloaded: a long request alone (its TTFT is the bare prefill time through the
serving plane) and a stream request alone (its TPOT is the bare decode step); the SLOs are printed next to them.
Per run the CPU time of every process this script started and of the whole machine (/proc/stat) is recorded:
"other CPU" is what processes not started here used during the run (other users of a shared machine). On a shared
machine, before each run the script waits (at most --quiet-wait s) until those use under 10% of it, and a run during
which they used more than --retry-above (25%) is repeated once (--retries), keeping the quieter attempt.

The rates: the --rates ladder, then (unless --no-find-knee) the last rate times --knee-factor, again and again,
until every mode has passed its knee — a step of the rate that raised its goodput by no more than KNEE_GAIN (5%) over
its best so far — or --max-rate is reached. The comparison then shows each mode's goodput past its knee, where
the modes differ; the rates actually run are the ones in the JSON and the tables. Each extra rate costs
--duration s per mode, and more past the knee (the tail after the last send grows).

Defaults, from calibration runs on the development machine (2-core AMD EPYC VM, small demo model, float32):
- rates 0.5,1,1.5,2 stream req/s (+0.25 long/s): colocated keeps up to about 1.5 (its output throughput levels
  off near 170 tok/s; at 2 it completes ~1.5 req/s and the tail after the last send grows), so the top rate is
  just past its ceiling. The ladder alone takes ~16 min with three modes on a quiet machine (--quick: rates 1,2,
  12 s each, ~3 min), a third more with disaggregated-auto, plus the knee search's rates.
- stream 128 in / 128 out: decode-heavy, each stream lives through one or two long prompts; long 1024 in / 8 out
  every 4 s: its prefill alone takes ~1 s on one core (~0.6 s on two threads), a quarter of the interval.
- The long prompts' output is short on purpose. pdserve's decode attention pads every sequence of a batch to the
  longest context, so while a 1k-token request decodes, every stream's step costs several times more (engine
  alone, 40 streams, one thread: 73 → 384 ms per step), in every mode, and more the larger the batch: it
  amplifies whichever mode falls behind. --long-output-len 1 takes it out (long requests then never decode: pure
  prefill interference); 32 makes it dominate.
- TTFT SLO 2500 ms: about 2.5× the long prompt's bare prefill on one core, so a long prompt that waits behind
  one other still passes; a stream prompt (128 tokens, ~0.15 s) misses it only when queued for seconds.
- TPOT SLO 100 ms: about 5× the unloaded TPOT through the stack (15-20 ms), twice the engine's one-thread decode
  step at 16 sequences: met by a decode that is busy but not stalled.

Outputs in --out: compare_pd.json (config, machine, probes, per mode per rate the summary with per_kind and the
per-request data), compare_pd.md (the tables), ttft_cdf.png, tpot_cdf.png, goodput_vs_rate.png,
tpot_over_time.png. A run where any request failed is reported loudly, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from services.bench.datasets import BenchRequest, interference_requests, random_requests  # noqa: E402
from services.bench.metrics import RequestRecord  # noqa: E402
from services.bench.runner import BenchConfig, BenchResult, run  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.proc_cpu import cpu_seconds as proc_cpu_s  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from shared.engine.kv_budget import CPU_KV_CACHE_BYTES  # noqa: E402
from shared.model.tokenizer import Tokenizer  # noqa: E402
from shared.telemetry import tracing  # noqa: E402
from shared.telemetry.spanfile import read_spans  # noqa: E402

MODES = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-auto")
# How the gateway picks each request's prefill path in the disaggregated modes (PDSERVE_PREFILL_PATH).
PREFILL_PATH = {"disaggregated": "remote", "disaggregated-auto": "auto"}
KNEE_GAIN = 0.05  # a rate step that raises goodput by no more than this (relative to the best so far) is past the knee
BASELINE = "colocated"
# Every prompt computed: the probes repeat theirs, warm-ups and retried runs repeat whole workloads, and a prefix
# cache would serve those from memory, hiding the very prefill work whose interference is measured here
# (prefix_cache.py measures the cache).
NO_CACHE = ("--no-prefix-caching",)
CLK_TCK = os.sysconf("SC_CLK_TCK")
KV_CACHE_BYTES = CPU_KV_CACHE_BYTES  # a CPU worker's default KV pool, for the memory estimate
OTHER_CPU_WARN = 0.10  # warn when other processes used more than this share of the machine during a run
QUIET_WINDOW_S = 3.0  # how long the machine is watched before a run to call it quiet

DEFAULTS = dict(rates="0.5,1,1.5,2", duration=60.0, probes=3, max_rate=16.0)
QUICK = dict(rates="1,2", duration=12.0, probes=1, max_rate=4.0)


# ---- pure helpers: ratios and tables ----------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None when either is missing or base is 0 (a ratio to nothing is not a number)."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def kind_summary(summary: dict, kind: str | None) -> dict:
    """The summary over one request kind (None: all requests). A run with a single kind has no per_kind."""
    if kind is None:
        return summary
    return summary.get("per_kind", {}).get(kind, summary)


def knee_passed(goodputs: list[float | None], min_gain: float = KNEE_GAIN) -> bool:
    """True once the last rate step raised goodput (req/s, in rate order) by no more than min_gain over the best
    before it (flat at 0 included): the mode is at or past its knee. A run without a goodput (None) counts as 0."""
    values = [g or 0.0 for g in goodputs]
    return len(values) >= 2 and values[-1] <= max(values[:-1]) * (1 + min_gain)


def next_rate(rates: list[float], factor: float, max_rate: float, goodputs: dict[str, list[float | None]]) -> float:
    """The rate to run next when searching for the knee, or 0 when done: every mode past its knee, or the next
    step (the last rate × factor) over max_rate."""
    if all(knee_passed(g) for g in goodputs.values()):
        return 0.0
    step = round(rates[-1] * factor, 3)
    return step if step <= max_rate else 0.0


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    numeric = ["---:" if i else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def stream_table(runs: list[dict], modes: list[str], rates: list[float]) -> str:
    """Mode × rate: achieved req/s (and the tail after the last send), failures, stream TTFT/TPOT/ITL, goodput
    and both ratios to the baseline."""
    by = {(r["mode"], r["rate"]): r for r in runs}
    header = ["mode", "stream req/s", "offered req/s", "achieved req/s", "tail s", "failed",
              "stream TTFT p50 / p99 ms", "stream TPOT p50 / p99 ms", "stream ITL p99 ms", "goodput req/s",
              "goodput vs colocated", "p99 TPOT vs colocated"]  # fmt: skip
    rows = []
    for rate in rates:
        base = by.get((BASELINE, rate))
        for mode in modes:
            run_ = by.get((mode, rate))
            if run_ is None:
                continue
            s, st = run_["summary"], kind_summary(run_["summary"], "stream")
            b = base["summary"] if base else None
            bst = kind_summary(b, "stream") if b else None
            failed = f"**{s['failed']}**" if s["failed"] else "0"
            rows.append([
                mode, fmt(rate, 1), fmt(run_["offered_rate"], 2), fmt(s["request_throughput"], 2),
                fmt(run_.get("tail_s")), failed,
                f"{fmt(st['median_ttft_ms'], 0)} / {fmt(st['p99_ttft_ms'], 0)}",
                f"{fmt(st['median_tpot_ms'])} / {fmt(st['p99_tpot_ms'])}",
                fmt(st["p99_itl_ms"], 0),
                fmt(s["request_goodput"], 2),
                fmt(ratio(s["request_goodput"], b["request_goodput"] if b else None), 2),
                fmt(ratio(st["p99_tpot_ms"], bst["p99_tpot_ms"] if bst else None), 2),
            ])  # fmt: skip
    return markdown_table(header, rows)


def all_table(runs: list[dict], modes: list[str], rates: list[float]) -> str:
    """Mode × rate over all requests, and the long prompts' TTFT; output throughput; other CPU during the run."""
    by = {(r["mode"], r["rate"]): r for r in runs}
    header = ["mode", "stream req/s", "all TTFT p50 / p99 ms", "all TPOT p50 / p99 ms", "all ITL p99 ms",
              "long TTFT p50 / p99 ms", "output tok/s", "other CPU"]  # fmt: skip
    rows = []
    for rate in rates:
        for mode in modes:
            run_ = by.get((mode, rate))
            if run_ is None:
                continue
            s, lg = run_["summary"], kind_summary(run_["summary"], "long")
            other = run_.get("cpu", {}).get("other_share")
            rows.append([
                mode, fmt(rate, 1),
                f"{fmt(s['median_ttft_ms'], 0)} / {fmt(s['p99_ttft_ms'], 0)}",
                f"{fmt(s['median_tpot_ms'])} / {fmt(s['p99_tpot_ms'])}",
                fmt(s["p99_itl_ms"], 0),
                f"{fmt(lg['median_ttft_ms'], 0)} / {fmt(lg['p99_ttft_ms'], 0)}",
                fmt(s["output_throughput"], 0),
                "—" if other is None else f"{other:.0%}",
            ])  # fmt: skip
    return markdown_table(header, rows)


def slo_context(slos: dict[str, float], probes: dict[str, dict]) -> str:
    """The SLOs as multiples of the unloaded probes: the slowest long-prompt TTFT and the fastest stream TPOT."""
    if not probes:
        return ""
    long_ttft = max(p["long_ttft_ms"] for p in probes.values())
    tpot = min(p["stream_tpot_ms"] for p in probes.values())
    return (f": {slos['ttft'] / long_ttft:.1f}× the slowest unloaded long-prompt TTFT ({long_ttft:.0f} ms) and "
            f"{slos['tpot'] / tpot:.1f}× the fastest unloaded stream TPOT ({tpot:.1f} ms)")  # fmt: skip


def probe_table(probes: dict[str, dict]) -> str:
    header = ["mode", "long prompt alone: TTFT ms", "stream alone: TTFT ms", "stream alone: TPOT ms", "other CPU"]
    rows = [[mode, fmt(p["long_ttft_ms"], 0), fmt(p["stream_ttft_ms"], 0), fmt(p["stream_tpot_ms"]),
             "—" if p.get("other_share") is None else f"{p['other_share']:.0%}"]
            for mode, p in probes.items()]  # fmt: skip
    return markdown_table(header, rows)


# ---- the model, the stacks and what runs on them ----------------------------------------------------------


def prepare_model(model_dir: str | None, size: str) -> Path:
    if model_dir:
        return Path(model_dir)
    return ensure_demo_checkpoint(REPO / "models" / f"demo-{size}-qwen3_moe", size=size)


def mode_spec(mode: str, model: Path, cores: tuple[int, int], chunk_budget: int, max_len: int, trace: Path | None,
              slos: dict[str, float] | None = None):  # fmt: skip
    """The StackSpec of one mode; both colocated modes get both cores, disaggregated one core per worker. The
    auto path's cost model is given the benchmark's goodput SLOs (`slos`), the ones it must choose within."""
    common = dict(model=str(model), port=free_port(), trace_file=str(trace) if trace else None)
    if mode == "colocated":  # a whole prompt per step: the budget must hold the longest prompt
        args = (*NO_CACHE, "--no-chunked-prefill", "--max-num-batched-tokens", str(max_len))
        return StackSpec(mixed=1, prefill=0, decode=0, threads={"mixed": 2}, cpu_affinity={"mixed": cores},
                         worker_args=args, **common)  # fmt: skip
    if mode == "colocated-chunked":
        args = (*NO_CACHE, "--max-num-batched-tokens", str(chunk_budget))
        return StackSpec(mixed=1, prefill=0, decode=0, threads={"mixed": 2}, cpu_affinity={"mixed": cores},
                         worker_args=args, **common)  # fmt: skip
    if mode in PREFILL_PATH:
        args = (*NO_CACHE, "--max-num-batched-tokens", str(chunk_budget))
        env = {"PDSERVE_PREFILL_PATH": PREFILL_PATH[mode]}
        if PREFILL_PATH[mode] == "auto" and slos:
            env |= {"PDSERVE_TTFT_SLO_MS": f"{slos['ttft']:g}", "PDSERVE_TPOT_SLO_MS": f"{slos['tpot']:g}"}
        return StackSpec(prefill=1, decode=1, threads={"prefill": 1, "decode": 1}, worker_args=args,
                         cpu_affinity={"prefill": cores[:1], "decode": cores[1:]}, env=env, **common)  # fmt: skip
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def machine_busy_s() -> tuple[float, float]:
    """CPU seconds the whole machine has spent busy (all cores), and stolen by the hypervisor, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def thread_affinity(pid: int) -> dict[str, int]:
    """Cpus_allowed_list of each thread of a process → how many threads have it."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    key = line.split(":", 1)[1].strip()
                    out[key] = out.get(key, 0) + 1
        except OSError:
            continue
    return out


def cpu_list(cpus: tuple[int, ...]) -> str:
    """The kernel's Cpus_allowed_list spelling of a set of CPU ids: 0-1, 0, 0,2-3."""
    ids, parts, i = sorted(set(cpus)), [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class ModeStack:
    mode: str
    spec: StackSpec
    stack: Stack | None = None
    facts: dict = field(default_factory=dict)

    def start(self) -> ModeStack:
        self.stack = Stack(self.spec)
        try:
            self.stack.start(ready_timeout_s=300)
        except Exception:
            print(self.stack.logs(), file=sys.stderr)
            raise
        self.facts = self.check_pinning()
        return self

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None

    def pids(self) -> list[int]:
        if self.stack is None:
            return []
        return [p.pid for p in self.stack.procs.values()] + [s.proc.pid for s in self.stack.infra]

    def worker_pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.stack.procs.items() if name != "gateway"}

    def check_pinning(self) -> dict:
        """Every thread of every worker must be on its role's CPUs; returns what was found (and RSS)."""
        facts = {}
        for name, pid in self.worker_pids().items():
            role = name.rsplit("-", 1)[0]
            want = cpu_list(self.spec.cpu_affinity[role])
            found = thread_affinity(pid)
            if set(found) != {want}:
                raise RuntimeError(f"{self.mode}: {name} threads are on CPUs {found}, expected all on {want}")
            facts[name] = {"cpus": want, "threads": sum(found.values()), "torch_threads": self.spec.threads[role],
                           "rss_mb": round(rss_mb(pid))}  # fmt: skip
        gw = self.stack.procs["gateway"].pid
        facts["gateway"] = {"cpus": ",".join(thread_affinity(gw)), "rss_mb": round(rss_mb(gw))}
        return facts

    def cpu_s(self) -> dict[str, float]:
        assert self.stack is not None, "start the stack first"
        return self.stack.cpu_seconds()


def estimate_worker_mb(model: Path) -> float:
    """Weights twice (the oneDNN-packed copy), the KV pool, and a few hundred MB of runtime."""
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return (2 * weights + KV_CACHE_BYTES) / 2**20 + 400


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_config(url: str, model_name: str, slos: dict[str, float], seed: int) -> BenchConfig:
    return BenchConfig(base_url=url, model=model_name, goodput_slos=slos, seed=seed, progress=False, timeout_s=300)


def run_requests(url: str, model_name: str, requests: list[BenchRequest], slos: dict, seed: int = 0) -> BenchResult:
    return run(bench_config(url, model_name, slos, seed), requests)


@dataclass(frozen=True)
class Workload:
    stream_input_len: int
    stream_output_len: int
    long_input_len: int
    long_output_len: int
    long_interval_s: float
    duration_s: float
    burstiness: float
    seed: int

    def requests(self, tok: Tokenizer, rate: float) -> list[BenchRequest]:
        return interference_requests(
            tok, self.duration_s, rate, self.stream_input_len, self.stream_output_len, self.long_interval_s,
            self.long_input_len, self.long_output_len, seed=self.seed, burstiness=self.burstiness,
        )  # fmt: skip

    def warmup(self, tok: Tokenizer) -> list[BenchRequest]:
        """One long prompt and three streams sent together (short outputs): wakes every worker's code paths."""
        long = random_requests(tok, 1, self.long_input_len, 4, seed=self.seed + 1000, kind="long")
        streams = random_requests(tok, 3, self.stream_input_len, 16, seed=self.seed + 1001, kind="stream")
        return [BenchRequest(r.prompt, r.prompt_len, r.output_len, r.kind, 0.0) for r in long + streams]


def probe(ms: ModeStack, tok: Tokenizer, model_name: str, wl: Workload, repeats: int) -> dict:
    """Unloaded reference points, medians over `repeats` (after one warm-up): a long request alone (its TTFT: the
    bare prefill time through the serving plane) and a stream request alone (TTFT, TPOT: the bare decode step)."""
    long = random_requests(tok, 1, wl.long_input_len, wl.long_output_len, seed=wl.seed + 2000, kind="long")
    stream = random_requests(tok, 1, wl.stream_input_len, wl.stream_output_len, seed=wl.seed + 2001, kind="stream")
    out: dict[str, list[float]] = {"long_ttft_ms": [], "stream_ttft_ms": [], "stream_tpot_ms": []}
    for i in range(repeats + 1):
        lr, sr = (run_requests(ms.stack.url, model_name, reqs, {}).records[0] for reqs in (long, stream))
        for rec in (lr, sr):
            if not rec.success:
                raise RuntimeError(f"{ms.mode}: a probe request failed: {rec.error}")
        if i == 0:
            continue  # warm-up
        out["long_ttft_ms"].append(lr.ttft_s * 1000)
        out["stream_ttft_ms"].append(sr.ttft_s * 1000)
        out["stream_tpot_ms"].append(sr.tpot_s * 1000)
    return {k: statistics.median(v) for k, v in out.items()} | {"samples": out}


def record_dict(r: RequestRecord) -> dict:
    """One request, compactly: times in seconds rounded to 10 µs."""
    return {
        "kind": r.kind, "prompt_len": r.prompt_len, "output_len": r.output_len, "success": r.success,
        "error": r.error, "start_s": round(r.start_s, 5), "ttft_s": round(r.ttft_s, 5),
        "latency_s": round(r.latency_s, 5), "output_tokens": r.output_tokens,
        "itl_s": [round(x, 5) for x in r.itl_s],
    }  # fmt: skip


def other_share(ours: list[int], window_s: float) -> float:
    """Share of the machine (all cores) that processes not in `ours` use over the next window_s seconds."""
    cpu0, (busy0, _) = sum(map(proc_cpu_s, ours)), machine_busy_s()
    time.sleep(window_s)
    cpu1, (busy1, _) = sum(map(proc_cpu_s, ours)), machine_busy_s()
    return max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / (window_s * (os.cpu_count() or 1))


def wait_quiet(ours: list[int], max_wait_s: float) -> tuple[float, float]:
    """Wait until other processes use under OTHER_CPU_WARN of the machine, at most max_wait_s: (waited s, share)."""
    t0 = time.monotonic()
    share = other_share(ours, QUIET_WINDOW_S)
    told = False
    while share >= OTHER_CPU_WARN and time.monotonic() - t0 < max_wait_s:
        if not told:
            print(f"  machine busy ({share:.0%} used by other processes): waiting up to {max_wait_s:g} s", flush=True)
            told = True
        share = other_share(ours, QUIET_WINDOW_S)
    return time.monotonic() - t0 - QUIET_WINDOW_S, share


def measure(ms: ModeStack, stacks: list[ModeStack], tok: Tokenizer, model_name: str, wl: Workload, rate: float,
            slos: dict, settle_s: float, quiet_wait_s: float) -> dict:  # fmt: skip
    """Wait for a quiet machine, warm up, then one measured run of the workload at `rate` on this mode's stack,
    with CPU accounting."""
    ours = [pid for s in stacks for pid in s.pids()] + [os.getpid()]
    waited, share_before = wait_quiet(ours, quiet_wait_s)
    warm = run_requests(ms.stack.url, model_name, wl.warmup(tok), {})
    if not all(r.success for r in warm.records):
        print(f"  !! warm-up on {ms.mode} had failures: {[r.error for r in warm.records if r.error][:2]}")
    time.sleep(settle_s)
    requests = wl.requests(tok, rate)
    cpu0, stack0, (busy0, steal0) = sum(map(proc_cpu_s, ours)), ms.cpu_s(), machine_busy_s()
    gen0, load0, t0 = proc_cpu_s(os.getpid()), os.getloadavg()[0], time.monotonic()
    started_ns = time.time_ns()  # the run's window on the spans' clock (path_predictions)
    result = run_requests(ms.stack.url, model_name, requests, slos, seed=wl.seed)
    wall = time.monotonic() - t0
    cpu1, stack1, (busy1, steal1) = sum(map(proc_cpu_s, ours)), ms.cpu_s(), machine_busy_s()
    ncpu = os.cpu_count() or 1
    other = max(0.0, (busy1 - busy0) - (cpu1 - cpu0))
    shares = {k: (stack1[k] - stack0[k]) / wall for k in stack0} | {
        "load generator": (proc_cpu_s(os.getpid()) - gen0) / wall
    }
    cpu = {
        "wall_s": wall,
        "quiet_wait_s": waited,
        "other_share_before": share_before,
        "machine_busy_share": (busy1 - busy0) / (wall * ncpu),
        "other_cpu_s": other,
        "other_share": other / (wall * ncpu),
        "steal_share": (steal1 - steal0) / (wall * ncpu),
        "loadavg_1m_before": load0,
        "loadavg_1m_after": os.getloadavg()[0],
        "per_process_busy_share": shares,  # 1.0 = one core busy for the whole run
    }
    return {
        "mode": ms.mode,
        "rate": rate,
        "window_ns": [started_ns, time.time_ns()],
        "offered_rate": rate + 1 / wl.long_interval_s,
        "num_requests": len(requests),
        # last send → last completion: one request's latency when the stack keeps up, growing when it falls behind
        "tail_s": result.duration_s - max(r.start_s for r in result.records),
        "summary": result.summary,
        "cpu": cpu,
        "long_send_s": [round(r.at_s, 5) for r in requests if r.kind == "long"],
        "records": [record_dict(r) for r in result.records],
    }


# ---- the per-request path: predicted against measured TTFT --------------------------------------------------


def path_predictions(spans: Iterable[dict], window_ns: tuple[int, int]) -> dict[str, dict]:
    """Per prefill path (remote | local), from the gateway's request spans that started in `window_ns`: how many
    requests took it, the p50 of the TTFT the cost model predicted for them and the p50 of their measured TTFT
    (ms), and measured / predicted (1.0: the model is right at the median)."""
    lo, hi = window_ns
    by_path: dict[str, tuple[list[float], list[float]]] = {}
    for span in spans:
        a = span.get("attributes", {})
        path, predicted, ttft = (
            a.get(tracing.PREFILL_PATH),
            a.get(tracing.PREFILL_PATH_PREDICTED_TTFT),
            a.get(tracing.GEN_AI_TTFT),
        )
        if path is None or predicted is None or ttft is None or not lo <= span["start_ns"] <= hi:
            continue
        pred, meas = by_path.setdefault(path, ([], []))
        pred.append(predicted * 1e3)
        meas.append(ttft * 1e3)
    out = {}
    for path, (pred, meas) in sorted(by_path.items()):
        p50_pred, p50_meas = statistics.median(pred), statistics.median(meas)
        out[path] = {"requests": len(pred), "predicted_ttft_p50_ms": p50_pred, "measured_ttft_p50_ms": p50_meas,
                     "measured_over_predicted": ratio(p50_meas, p50_pred)}  # fmt: skip
    return out


def predictions_table(runs: list[dict]) -> str:
    rows = [[r["mode"], f"{r['rate']:g}", path, str(p["requests"]), fmt(p["predicted_ttft_p50_ms"], 0),
             fmt(p["measured_ttft_p50_ms"], 0), fmt(p["measured_over_predicted"], 2)]
            for r in runs for path, p in r.get("prefill_paths", {}).items()]  # fmt: skip
    header = [
        "mode",
        "rate",
        "path",
        "requests",
        "predicted TTFT p50 ms",
        "measured TTFT p50 ms",
        "measured / predicted",
    ]
    return markdown_table(header, rows)


def add_path_predictions(data: dict, out: Path) -> None:
    """Each traced run of a mode that chooses paths gets its `prefill_paths` (path_predictions)."""
    for measured in data["runs"]:
        spans_file = out / f"spans-{measured['mode']}.jsonl"
        if PREFILL_PATH.get(measured["mode"]) == "auto" and spans_file.exists():
            measured["prefill_paths"] = path_predictions(read_spans(spans_file), tuple(measured["window_ns"]))


# ---- plots ------------------------------------------------------------------------------------------------

COLORS = {"colocated": "tab:red", "colocated-chunked": "tab:orange", "disaggregated": "tab:blue",
          "disaggregated-auto": "tab:green"}  # fmt: skip


def _plain_log_ticks(axis) -> None:
    """Log axis ticked and labelled 50, 100, 200, 500 ... instead of 5×10^1 (minor labels off: they collide)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _cdf(ax, values: list[float], label: str, color: str | None) -> None:
    xs = sorted(values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, color=color, drawstyle="steps-post")


def tpot_ms(rec: dict) -> float | None:
    if not rec["success"] or rec["output_tokens"] <= 1:
        return None
    return (rec["latency_s"] - rec["ttft_s"]) / (rec["output_tokens"] - 1) * 1000


def plot_all(data: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, modes, rates = data["runs"], data["config"]["modes"], data["config"]["rates"]
    slos = data["config"]["slos_ms"]
    top = max(rates)
    at_top = {r["mode"]: r for r in runs if r["rate"] == top}
    files = []

    def ok(run_: dict, kind: str) -> list[dict]:
        return [x for x in run_["records"] if x["success"] and x["kind"] == kind]

    def save(fig, name: str, dpi: int = 120) -> None:
        fig.tight_layout()
        files.append(out / name)
        fig.savefig(files[-1], dpi=dpi)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, ax in zip(("stream", "long"), axes, strict=True):
        for mode in modes:
            if mode in at_top:
                _cdf(ax, [x["ttft_s"] * 1000 for x in ok(at_top[mode], kind)], mode, COLORS.get(mode))
        ax.axvline(slos["ttft"], color="gray", linestyle=":", label=f"TTFT SLO {slos['ttft']:.0f} ms")
        ax.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title=f'"{kind}" requests')
        _plain_log_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"TTFT CDF at {top:g} stream req/s")
    save(fig, "ttft_cdf.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        if mode in at_top:
            _cdf(axes[0], [t for x in ok(at_top[mode], "stream") if (t := tpot_ms(x)) is not None], mode,
                 COLORS.get(mode))  # fmt: skip
            _cdf(axes[1], [g * 1000 for x in ok(at_top[mode], "stream") for g in x["itl_s"]], mode, COLORS.get(mode))
    axes[0].axvline(slos["tpot"], color="gray", linestyle=":", label=f"TPOT SLO {slos['tpot']:.0f} ms")
    axes[0].set(xlabel="TPOT per request (ms)", ylabel="fraction of stream requests", title="TPOT (per request)")
    axes[1].set(xscale="log", xlabel="inter-token gap (ms)", ylabel="fraction of gaps", title="ITL (every gap)")
    _plain_log_ticks(axes[1].xaxis)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f'"stream" requests at {top:g} stream req/s')
    save(fig, "tpot_cdf.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        pts = sorted((r["rate"], r["summary"]) for r in runs if r["mode"] == mode)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["request_goodput"] for p in pts], "o-", label=mode, color=COLORS.get(mode))
        axes[0].plot(xs, [p[1]["request_throughput"] for p in pts], "x:", color=COLORS.get(mode), alpha=0.6)
        axes[1].plot(xs, [kind_summary(p[1], "stream")["p99_tpot_ms"] for p in pts], "o-", label=mode,
                     color=COLORS.get(mode))  # fmt: skip
    offered = [r + 1 / data["config"]["workload"]["long_interval_s"] for r in rates]
    axes[0].plot(rates, offered, color="gray", linestyle="--", label="offered")
    axes[0].set(
        xlabel="stream rate (req/s)",
        ylabel="req/s",
        title=f"goodput (o, TTFT≤{slos['ttft']:.0f} ms & TPOT≤{slos['tpot']:.0f} ms) and throughput (x)",
    )
    axes[1].axhline(slos["tpot"], color="gray", linestyle=":", label="TPOT SLO")
    axes[1].set(xlabel="stream rate (req/s)", ylabel="ms", title='p99 TPOT of "stream" requests')
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "goodput_vs_rate.png")

    shown = [m for m in modes if m in at_top]
    fig, axes = plt.subplots(len(shown), 1, figsize=(13, 3.2 * len(shown)), sharex=True, sharey=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], shown, strict=True):
        run_ = at_top[mode]
        xs, ys = [], []
        for x in ok(run_, "stream"):
            t = x["start_s"] + x["ttft_s"]
            for gap in x["itl_s"]:
                t += gap
                xs.append(t)
                ys.append(max(gap * 1000, 1.0))  # tokens that arrive together (after a stall) drawn at 1 ms
        ax.scatter(xs, ys, s=2, alpha=0.35, color=COLORS.get(mode), linewidths=0, label="stream inter-token gap")
        for i, t in enumerate(run_["long_send_s"]):
            ax.axvline(t, color="black", alpha=0.5, linewidth=0.8, label="long prompt sent" if i == 0 else None)
        ax.axhline(slos["tpot"], color="gray", linestyle=":", label=f"TPOT SLO {slos['tpot']:.0f} ms")
        st = kind_summary(run_["summary"], "stream")
        ax.set(yscale="log", ylabel="gap (ms; < 1 drawn at 1)",
               title=f"{mode}: stream ITL p50 {st['median_itl_ms']:.0f} ms, p99 {st['p99_itl_ms']:.0f} ms, "
                     f"TPOT p99 {st['p99_tpot_ms']:.0f} ms")  # fmt: skip
        _plain_log_ticks(ax.yaxis)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel(f"time since the run's start (s), {top:g} stream req/s")
    save(fig, "tpot_over_time.png", dpi=110)
    return files


# ---- report -----------------------------------------------------------------------------------------------


def report(data: dict) -> str:
    cfg, modes, rates = data["config"], data["config"]["modes"], data["config"]["rates"]
    wl, slos = cfg["workload"], cfg["slos_ms"]
    failed = [(r["mode"], r["rate"], r["summary"]["failed"]) for r in data["runs"] if r["summary"]["failed"]]
    busy = [(r["mode"], r["rate"], r["cpu"]["other_share"]) for r in data["runs"]
            if r["cpu"]["other_share"] > OTHER_CPU_WARN]  # fmt: skip
    lines = [
        f"# Colocated vs disaggregated ({data['date']})",
        "",
        f"Model {data['machine']['model']}; {data['machine']['cpus']} CPUs ({data['machine']['cpu_model']}); "
        f"cores {cfg['cores']}; torch {data['machine']['torch']}.",
        f"Workload: stream {wl['stream_input_len']} in / {wl['stream_output_len']} out at the stream rate (Poisson, "
        f"burstiness {wl['burstiness']:g}) + long {wl['long_input_len']} in / {wl['long_output_len']} out every "
        f"{wl['long_interval_s']:g} s; {wl['duration_s']:g} s per run; chunk budget {cfg['chunk_budget']}.",
        f"Goodput SLOs: TTFT ≤ {slos['ttft']:.0f} ms and TPOT ≤ {slos['tpot']:.0f} ms (every request)"
        + slo_context(slos, data["probes"])
        + ".",
        "",
        "Unloaded (one request at a time):",
        "",
        probe_table(data["probes"]),
        "",
        '"stream" requests (the decode-heavy ones long prompts stall); goodput over all requests:',
        "",
        stream_table(data["runs"], modes, rates),
        "",
        "All requests, and the long prompts alone:",
        "",
        all_table(data["runs"], modes, rates),
        "",
    ]
    if any(r.get("prefill_paths") for r in data["runs"]):
        lines += ["The per-request path, predicted against measured TTFT (gateway request spans, `--trace`):", "",
                  predictions_table(data["runs"]), ""]  # fmt: skip
    if failed:
        lines.append("**FAILED REQUESTS: " + "; ".join(f"{m} @ {r:g}: {n}" for m, r, n in failed) + "**")
    else:
        lines.append("Every request of every run completed (0 failed).")
    if busy:
        lines.append("Other processes were busy during: " + "; ".join(f"{m} @ {r:g} ({s:.0%})" for m, r, s in busy))
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a short try: {QUICK}")
    p.add_argument("--rates", help=f"stream rates, req/s (default {DEFAULTS['rates']}; quick {QUICK['rates']})")
    p.add_argument("--duration", type=float, help=f"s per run (default {DEFAULTS['duration']:g})")
    p.add_argument("--no-find-knee", dest="find_knee", action="store_false",
                   help="run the --rates ladder only (default: go on stepping the rate until every mode's goodput "
                   "has stopped rising)")  # fmt: skip
    p.add_argument("--knee-factor", type=float, default=1.5, help="each rate past the ladder: the last × this")
    p.add_argument("--max-rate", type=float, help="the knee search stops before going over this (default "
                   f"{DEFAULTS['max_rate']:g}; quick {QUICK['max_rate']:g})")  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--model", help="checkpoint directory (default: the small demo model, written if missing)")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--cores", default="0,1", help="two CPU ids: colocated workers get both, P first, D second")
    p.add_argument("--chunk-budget", type=int, default=512, help="tokens per step with chunked prefill")
    p.add_argument("--stream-input-len", type=int, default=128)
    p.add_argument("--stream-output-len", type=int, default=128)
    p.add_argument("--long-input-len", type=int, default=1024)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=4.0, help="s between long prompts")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--probes", type=int, help="unloaded probe repeats per mode")
    p.add_argument("--settle", type=float, default=2.0, help="s of quiet after each warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="before each run, wait up to this many s for other processes to use < 10%% of the machine",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run again when other processes used more than --retry-above of the machine during a run",
    )
    p.add_argument("--retry-above", type=float, default=0.25, help="share of all cores (0-1)")  # fmt: skip
    p.add_argument("--one-stack-at-a-time", action="store_true", help="start/stop a stack per run (less memory)")
    p.add_argument("--trace", action="store_true", help="stacks write spans to OUT/spans-<mode>.jsonl")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compare_pd"))
    p.add_argument("--replot", metavar="JSON", help="only redo the table and plots from a compare_pd.json")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    args.rates = [float(x) for x in (args.rates or preset["rates"]).split(",")]
    args.max_rate = args.max_rate or preset["max_rate"]
    if args.knee_factor <= 1:
        p.error("--knee-factor must be above 1")
    args.duration = args.duration or preset["duration"]
    args.probes = args.probes or preset["probes"]
    args.modes = [m.strip() for m in args.modes.split(",")]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    args.cores = tuple(int(x) for x in args.cores.split(","))
    if len(args.cores) != 2 or len(set(args.cores)) != 2:
        p.error("--cores takes two distinct CPU ids")
    return args


def machine_facts(model: Path) -> dict:
    import torch

    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())  # fmt: skip
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model, "mem_total_mb": int(mem) // 1024,
            "torch": torch.__version__, "python": platform.python_version(), "model": model.name,
            "model_config": json.loads((model / "config.json").read_text())}  # fmt: skip


def finish(data: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    text = report(data)
    (out / "compare_pd.md").write_text(text)
    files = plot_all(data, out)
    print("\n" + text)
    print(f"wrote {out / 'compare_pd.json'}, {out / 'compare_pd.md'}")
    print("plots: " + ", ".join(str(f) for f in files))
    failed = sum(r["summary"]["failed"] for r in data["runs"])
    if failed:
        print(f"\n!!! {failed} REQUESTS FAILED — these results are not a clean comparison !!!", file=sys.stderr)
    return 1 if failed else 0


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        return finish(data, Path(args.out) if "--out" in (argv or sys.argv) else Path(args.replot).parent)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the stacks on SIGTERM too (background runs ignore SIGINT)
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model, args.size)
    model_cfg = json.loads((model / "config.json").read_text())
    max_len = int(model_cfg["max_position_embeddings"])
    tok = Tokenizer(model)
    model_name = model.name
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    wl = Workload(args.stream_input_len, args.stream_output_len, args.long_input_len, args.long_output_len,
                  args.long_interval, args.duration, args.burstiness, args.seed)  # fmt: skip
    stacks = {}
    for m in args.modes:
        trace = out / f"spans-{m}.jsonl" if args.trace else None
        stacks[m] = ModeStack(m, mode_spec(m, model, args.cores, args.chunk_budget, max_len, trace, slos))
    workers = sum((s.spec.mixed or s.spec.prefill + s.spec.decode) for s in stacks.values())
    need, have = workers * estimate_worker_mb(model), available_mb()
    together = not args.one_stack_at_a_time and need * 1.3 < have
    print(f"model {model}; cores {args.cores}; {workers} workers need ~{need:.0f} MB, {have:.0f} MB available: "
          f"{'all stacks up front' if together else 'one stack at a time'}", flush=True)  # fmt: skip
    print(f"SLOs: TTFT <= {slos['ttft']:.0f} ms, TPOT <= {slos['tpot']:.0f} ms; rates {args.rates}; "
          f"{args.duration:g} s per run", flush=True)  # fmt: skip
    data = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {"modes": args.modes, "rates": args.rates, "cores": list(args.cores), "chunk_budget":
                   args.chunk_budget, "slos_ms": slos, "workload": wl.__dict__, "stacks_together": together,
                   "quick": args.quick, "argv": sys.argv[1:]},
        "machine": machine_facts(model),
        "probes": {},
        "stacks": {},
        "runs": [],
    }  # fmt: skip
    try:
        if together:
            for ms in stacks.values():
                print(f"starting {ms.mode} ...", flush=True)
                ms.start()
        ncpu = os.cpu_count() or 1
        for mode, ms in stacks.items():
            if not together:
                ms.start()
            data["stacks"][mode] = ms.facts
            ours = [pid for s in stacks.values() for pid in s.pids()] + [os.getpid()]
            wait_quiet(ours, args.quiet_wait)
            cpu0, (busy0, _), t0 = sum(map(proc_cpu_s, ours)), machine_busy_s(), time.monotonic()
            p = probe(ms, tok, model_name, wl, args.probes)
            cpu1, (busy1, _) = sum(map(proc_cpu_s, ours)), machine_busy_s()
            p["other_share"] = max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / ((time.monotonic() - t0) * ncpu)
            data["probes"][mode] = p
            print(f"{mode}: pinned {ms.facts}\n  unloaded: long TTFT {p['long_ttft_ms']:.0f} ms, stream TTFT "
                  f"{p['stream_ttft_ms']:.0f} ms, stream TPOT {p['stream_tpot_ms']:.1f} ms (other CPU "
                  f"{p['other_share']:.0%})", flush=True)  # fmt: skip
            if not together:
                ms.stop()
        goodputs: dict[str, list[float | None]] = {m: [] for m in args.modes}
        i = 0
        while i < len(args.rates):  # args.rates (also data["config"]["rates"]) grows while the knee is searched
            rate = args.rates[i]
            order = args.modes[i % len(args.modes) :] + args.modes[: i % len(args.modes)]
            for mode in order:
                ms = stacks[mode]
                if not together:
                    ms.start()
                try:
                    res, shares = None, []
                    for attempt in range(args.retries + 1):
                        got = measure(ms, [s for s in stacks.values() if s.stack], tok, model_name, wl, rate, slos,
                                      args.settle, args.quiet_wait)  # fmt: skip
                        shares.append(got["cpu"]["other_share"])
                        if res is None or shares[-1] < res["cpu"]["other_share"]:
                            res = got
                        if shares[-1] <= args.retry_above or attempt == args.retries:
                            break
                        print(f"  other processes used {shares[-1]:.0%} of the machine during {mode} @ {rate:g}: "
                              "running it again (the quieter attempt is kept)", flush=True)  # fmt: skip
                    res["attempts_other_share"] = shares
                finally:
                    if not together:
                        ms.stop()
                data["runs"].append(res)
                s, st = res["summary"], kind_summary(res["summary"], "stream")
                flag = f"  !!! {s['failed']} FAILED: {next(r['error'] for r in res['records'] if not r['success'])}" \
                    if s["failed"] else ""  # fmt: skip
                print(f"[{time.monotonic() - t_start:5.0f}s] rate {rate:g} {mode:18} {s['completed']}/"
                      f"{res['num_requests']} ok, {s['request_throughput']:.2f} req/s, goodput "
                      f"{s['request_goodput']:.2f}, stream TPOT p50/p99 {st['median_tpot_ms']:.1f}/"
                      f"{st['p99_tpot_ms']:.1f} ms, ITL p99 {st['p99_itl_ms']:.0f} ms, other CPU "
                      f"{res['cpu']['other_share']:.0%}{flag}", flush=True)  # fmt: skip
                (out / "compare_pd.json").write_text(json.dumps(data))  # partial results survive a crash
                goodputs[mode].append(s["request_goodput"])
            i += 1
            if i == len(args.rates) and args.find_knee:
                if more := next_rate(args.rates, args.knee_factor, args.max_rate, goodputs):
                    print(f"  goodput still rising in {[m for m, g in goodputs.items() if not knee_passed(g)]}: "
                          f"next rate {more:g}", flush=True)  # fmt: skip
                    args.rates.append(more)
    finally:
        for ms in stacks.values():
            ms.stop()
    data["runtime_s"] = time.monotonic() - t_start
    add_path_predictions(data, out)
    (out / "compare_pd.json").write_text(json.dumps(data))
    code = finish(data, out)
    print(f"runtime {data['runtime_s'] / 60:.1f} min")
    return code


if __name__ == "__main__":
    sys.exit(main())
