"""Prefix caching and cache-aware routing on one stack (2 prefill workers + 1 decode worker), on the shared-prefix
and multi-turn workloads of `pdserve bench`, in three modes.

    .venv/bin/python benchmarks/prefix_cache.py [--quick] [--modes no-cache,cache-queue,cache-kv-aware]
        [--size small] [--threads 1] [--out DIR] [workload flags, --help]

Modes (MODES below is the one place that says how each is set up):
- no-cache: the workers run without a prefix cache (`--no-prefix-caching`);
- cache-queue: prefix cache on, the gateway hands prefills to the shared work queue (PDSERVE_KV_AWARE_ROUTING=0),
  so a group's requests land on whichever prefill worker is free and each worker fills its own cache;
- cache-kv-aware: prefix cache on, the gateway sends a request to the worker that holds most of its prefix (the
  default).
Each mode gets a fresh stack (`pdserve up`'s launcher: nats-server, redis-server, gateway, workers), warmed up with
unrelated random requests, then runs:
- shared-prefix: --groups prefixes of --prefix-len tokens, each request its group's prefix (the chat system
  message) + a --suffix-len-token question, --num-prompts requests interleaved across the groups, Poisson at
  --prefix-rate req/s;
- multi-turn: --conversations conversations of --turns turns arriving at --conversation-rate/s; each turn resends
  the history (earlier questions and the streamed answers) + a new --turn-input-len-token question, --think-time
  s after the previous answer.
Requests are chat, greedy, ignore_eos. Reported per mode and workload: TTFT p50/p99, request and output
throughput, the prefix cache hit rate (usage.prompt_tokens_details.cached_tokens / prompt tokens; "—" when the
server reports none), the KV bytes the decode worker pulled per request (its pdserve:kv_transfer_bytes_total
before/after; for multi-turn: bytes moved per turn), TTFT p50 by turn; and the ratios cache-kv-aware / no-cache
TTFT p50 and cache-kv-aware / cache-queue hit rate. Outputs in --out: prefix_cache.json (config, machine, every
summary) and prefix_cache.md. A run where any request failed is reported and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.compare_pd import fmt, markdown_table, prepare_model, ratio  # noqa: E402
from benchmarks.host_info import cpu_info, load_average  # noqa: E402
from services.bench.datasets import random_requests  # noqa: E402
from services.bench.prefix_workloads import multi_turn_conversations, prompt_share, shared_prefix_requests  # noqa: E402
from services.bench.runner import BenchConfig, run  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from shared.model.tokenizer import Tokenizer  # noqa: E402


@dataclass(frozen=True)
class Mode:
    """How one mode's stack is started: flags for every worker, environment for every service."""

    about: str
    worker_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


# Every mode disaggregates every request (PDSERVE_PREFILL_PATH=remote): the per-request path (compare_pd.py) would
# send a conversation's short first turn to the decode worker, mixing that choice into what is measured here.
_REMOTE = {"PDSERVE_PREFILL_PATH": "remote"}
MODES = {
    "no-cache": Mode("workers without a prefix cache", worker_args=("--no-prefix-caching",), env=_REMOTE),
    "cache-queue": Mode("prefix cache, shared work queue", env=_REMOTE | {"PDSERVE_KV_AWARE_ROUTING": "0"}),
    "cache-kv-aware-whole-pulls": Mode(
        "prefix cache, KV-aware routing, decode pulls every block (no decode-side reuse)",
        env=_REMOTE | {"PDSERVE_DECODE_KV_REUSE": "0"},
    ),
    "cache-kv-aware": Mode("prefix cache, KV-aware routing and decode-side reuse (default)", env=_REMOTE),
}
WORKLOADS = ("shared-prefix", "multi-turn")
PREFILL_WORKERS, DECODE_WORKERS = 2, 1

DEFAULTS = dict(num_prompts=64, conversations=16)
QUICK = dict(num_prompts=16, conversations=4)


@dataclass(frozen=True)
class Workloads:
    groups: int
    prefix_len: int
    suffix_len: int
    prefix_output_len: int
    num_prompts: int
    prefix_rate: float
    conversations: int
    turns: int
    turn_input_len: int
    turn_output_len: int
    think_time: float
    conversation_rate: float
    seed: int

    def build(self, tok: Tokenizer, name: str) -> list:
        if name == "shared-prefix":
            return shared_prefix_requests(tok, self.groups, self.num_prompts, self.prefix_len, self.suffix_len,
                                          self.prefix_output_len, self.seed)  # fmt: skip
        return multi_turn_conversations(tok, self.conversations, self.turns, self.turn_input_len,
                                        self.turn_output_len, self.think_time, self.seed)  # fmt: skip

    def rate(self, name: str) -> float:
        return self.prefix_rate if name == "shared-prefix" else self.conversation_rate


PRESSURE_MAX_MODEL_LEN = 2048  # past every request of the workloads here (a 12-turn conversation is under 1k)


def start_stack(mode: Mode, model: Path, threads: int, prefill_kv_cache_bytes: int | None = None) -> Stack:
    """The mode's stack; `prefill_kv_cache_bytes`: the prefill workers' KV pool (the cache under pressure), else
    the workers' default; with it their context is PRESSURE_MAX_MODEL_LEN (a pool must hold one whole request)."""
    prefill_args = ()
    if prefill_kv_cache_bytes is not None:
        prefill_args = ("--kv-cache-bytes", str(prefill_kv_cache_bytes), "--max-model-len", str(PRESSURE_MAX_MODEL_LEN))
    spec = StackSpec(model=str(model), port=free_port(), prefill=PREFILL_WORKERS, decode=DECODE_WORKERS,
                     threads_per_worker=threads, worker_args=mode.worker_args, env=dict(mode.env),
                     role_args={"prefill": prefill_args})  # fmt: skip
    stack = Stack(spec)
    try:
        stack.start(ready_timeout_s=300)
    except Exception:
        print(stack.logs(), file=sys.stderr)
        stack.stop()
        raise
    return stack


def warm_up(stack: Stack, model_name: str, tok: Tokenizer, seed: int) -> None:
    """Random prompts that share nothing with the workloads, sent together so both prefill workers wake up."""
    reqs = random_requests(tok, 2 * PREFILL_WORKERS, 64, 4, seed=seed + 1000)
    result = run(BenchConfig(base_url=stack.url, model=model_name, endpoint="chat", progress=False), reqs)
    if not all(r.success for r in result.records):
        raise RuntimeError(f"warm-up failed: {[r.error for r in result.records if r.error][:2]}")


def measure(stack: Stack, model_name: str, tok: Tokenizer, wl: Workloads, name: str) -> dict:
    """One run of a workload on a started stack: the bench summary (with the decode worker's KV bytes)."""
    items = wl.build(tok, name)
    config = BenchConfig(base_url=stack.url, model=model_name, endpoint="chat", request_rate=wl.rate(name),
                         seed=wl.seed, progress=False, timeout_s=300,
                         kv_metrics_urls=tuple(stack.metrics_urls()))  # fmt: skip
    load0 = load_average()[0]
    result = run(config, items)
    out = {"summary": result.summary, "loadavg_1m": [load0, load_average()[0]]}
    if name == "shared-prefix":
        out["prompt_share"] = prompt_share(items)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        out["first_errors"] = failed[:3]
    return out


# ---- report -----------------------------------------------------------------------------------------------


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{share:.1%}"


def results_table(runs: dict, modes: list[str]) -> str:
    header = ["workload", "mode", "ok / failed", "TTFT p50 / p99 ms", "req/s", "output tok/s", "cache hit rate",
              "KV bytes pulled / request"]  # fmt: skip
    rows = []
    for name in WORKLOADS:
        for mode in modes:
            if (r := runs.get(mode, {}).get(name)) is None:
                continue
            s = r["summary"]
            rows.append([name, mode, f"{s['completed']} / {s['failed']}",
                         f"{fmt(s['median_ttft_ms'], 0)} / {fmt(s['p99_ttft_ms'], 0)}", fmt(s["request_throughput"], 2),
                         fmt(s["output_throughput"], 0), _pct(s["prefix_cache_hit_rate"]),
                         fmt(s.get("kv_bytes_per_request"), 0)])  # fmt: skip
    return markdown_table(header, rows)


def ratios(runs: dict) -> dict[str, dict[str, float | None]]:
    """Per workload: cache-kv-aware / no-cache TTFT p50 (below 1: the cache saves prefill time),
    cache-kv-aware / cache-queue hit rate (above 1: routing finds the cached prefixes the queue misses), and
    cache-kv-aware / cache-kv-aware-whole-pulls KV bytes per request (below 1: decode-side reuse moves less)."""

    def get(mode: str, name: str, key: str) -> float | None:
        return runs.get(mode, {}).get(name, {}).get("summary", {}).get(key)

    return {
        name: {
            "ttft_p50_kv_aware_over_no_cache": ratio(
                get("cache-kv-aware", name, "median_ttft_ms"), get("no-cache", name, "median_ttft_ms")
            ),
            "hit_rate_kv_aware_over_queue": ratio(
                get("cache-kv-aware", name, "prefix_cache_hit_rate"), get("cache-queue", name, "prefix_cache_hit_rate")
            ),
            "kv_bytes_reuse_over_whole_pulls": ratio(
                get("cache-kv-aware", name, "kv_bytes_per_request"),
                get("cache-kv-aware-whole-pulls", name, "kv_bytes_per_request"),
            ),
        }
        for name in WORKLOADS
    }


def turns_table(runs: dict, modes: list[str]) -> str:
    per_mode = {m: runs.get(m, {}).get("multi-turn", {}).get("summary", {}).get("per_turn", {}) for m in modes}
    turns = sorted({int(t) for per in per_mode.values() for t in per})
    header = ["mode"] + [f"turn {t}: TTFT p50 ms / hit rate" for t in turns]
    rows = [[m] + [f"{fmt(per[str(t)]['median_ttft_ms'], 0)} / {_pct(per[str(t)]['prefix_cache_hit_rate'])}"
                   if str(t) in per else "—" for t in turns] for m, per in per_mode.items() if per]  # fmt: skip
    return markdown_table(header, rows)


def report(data: dict) -> str:
    wl, m, modes = data["config"]["workloads"], data["machine"], data["config"]["modes"]
    rows = [[name, fmt(r["ttft_p50_kv_aware_over_no_cache"], 2), fmt(r["hit_rate_kv_aware_over_queue"], 2),
             fmt(r["kv_bytes_reuse_over_whole_pulls"], 2)] for name, r in data["ratios"].items()]  # fmt: skip
    failed = [(mode, name, r["summary"]["failed"]) for mode, per in data["runs"].items() for name, r in per.items()
              if r["summary"]["failed"]]  # fmt: skip
    lines = [
        f"# Prefix cache: {PREFILL_WORKERS} prefill + {DECODE_WORKERS} decode workers ({data['date']})",
        "",
        f"Model {m['model']}; {m['cpu']} ({m['cpu_count']} CPUs), {data['config']['threads']} thread(s) per worker; "
        f"torch {m['torch']}.",
        f"shared-prefix: {wl['groups']} groups × {wl['prefix_len']}-token prefix + {wl['suffix_len']}-token "
        f"suffix, {wl['num_prompts']} requests at {wl['prefix_rate']:g} req/s, {wl['prefix_output_len']} out.",
        f"multi-turn: {wl['conversations']} conversations × {wl['turns']} turns ({wl['turn_input_len']} in, "
        f"{wl['turn_output_len']} out per turn, think {wl['think_time']:g} s) at {wl['conversation_rate']:g}/s.",
        "",
        "Modes: " + "; ".join(f"{name}: {MODES[name].about}" for name in modes) + ".",
        "",
        results_table(data["runs"], modes),
        "",
        "Ratios (TTFT: below 1 is faster than no cache; hit rate: above 1 is KV-aware routing finding more; KV "
        "bytes: below 1 is decode-side reuse moving less):",
        "",
        markdown_table(
            [
                "workload",
                "TTFT p50 kv-aware / no-cache",
                "hit rate kv-aware / queue",
                "KV bytes/request reuse / whole pulls",
            ],
            rows,
        ),  # fmt: skip
        "",
        "Multi-turn by turn:",
        "",
        turns_table(data["runs"], modes),
        "",
    ]
    if failed:
        lines.append("**FAILED REQUESTS: " + "; ".join(f"{a} {b}: {n}" for a, b, n in failed) + "**")
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a short try: {QUICK}")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--model", help="checkpoint directory (default: the small demo model, written if missing)")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=128, help="with --prefix-len 512: a prefix share of 80%%")
    p.add_argument("--prefix-output-len", type=int, default=8)
    p.add_argument("--num-prompts", type=int, help=f"shared-prefix requests (default {DEFAULTS['num_prompts']})")
    p.add_argument("--prefix-rate", type=float, default=2.0, help="shared-prefix requests/s")
    p.add_argument("--conversations", type=int, help=f"multi-turn (default {DEFAULTS['conversations']})")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-input-len", type=int, default=64)
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--think-time", type=float, default=0.5)
    p.add_argument("--conversation-rate", type=float, default=1.0, help="conversations/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-kv-cache-bytes", type=int, help="the prefill workers' KV pool (default: the workers' "
                   "own, 256 MiB on CPU): small enough that each holds only some of the prefixes, the cache under "
                   "pressure, as a busy deployment's")  # fmt: skip
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prefix_cache"))
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    args.num_prompts = args.num_prompts or preset["num_prompts"]
    args.conversations = args.conversations or preset["conversations"]
    args.modes = [m.strip() for m in args.modes.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",")]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; workloads: {', '.join(WORKLOADS)}")
    return args


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the stack on SIGTERM too
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model, args.size)
    tok, model_name = Tokenizer(model), model.name
    wl = Workloads(args.groups, args.prefix_len, args.suffix_len, args.prefix_output_len, args.num_prompts,
                   args.prefix_rate, args.conversations, args.turns, args.turn_input_len, args.turn_output_len,
                   args.think_time, args.conversation_rate, args.seed)  # fmt: skip
    data: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {"modes": args.modes, "workloads": asdict(wl), "run": args.workloads, "threads": args.threads,
                   "prefill_workers": PREFILL_WORKERS, "decode_workers": DECODE_WORKERS,
                   "mode_setup": {m: asdict(MODES[m]) for m in args.modes}, "quick": args.quick,
                   "prefill_kv_cache_bytes": args.prefill_kv_cache_bytes,
                   "argv": sys.argv[1:]},
        "machine": cpu_info() | {"model": model.name, "torch": torch.__version__, "python": platform.python_version(),
                                 "loadavg_start": load_average()},
        "runs": {},
    }  # fmt: skip
    t0 = time.monotonic()
    for mode in args.modes:
        print(f"[{time.monotonic() - t0:5.0f}s] {mode}: starting the stack ({MODES[mode].about})", flush=True)
        stack = start_stack(MODES[mode], model, args.threads, args.prefill_kv_cache_bytes)
        try:
            warm_up(stack, model_name, tok, args.seed)
            for name in args.workloads:
                got = measure(stack, model_name, tok, wl, name)
                data["runs"].setdefault(mode, {})[name] = got
                s = got["summary"]
                print(f"[{time.monotonic() - t0:5.0f}s] {mode} {name}: {s['completed']} ok, {s['failed']} failed, "
                      f"TTFT p50 {s['median_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms, "
                      f"{s['request_throughput']:.2f} req/s, hit rate {_pct(s['prefix_cache_hit_rate'])}, "
                      f"KV bytes/request {fmt(s.get('kv_bytes_per_request'), 0)}", flush=True)  # fmt: skip
                (out / "prefix_cache.json").write_text(json.dumps(data))  # partial results survive a crash
        finally:
            stack.stop()
    data["ratios"] = ratios(data["runs"])
    data["runtime_s"] = time.monotonic() - t0
    (out / "prefix_cache.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    (out / "prefix_cache.md").write_text(text)
    print("\n" + text)
    print(f"wrote {out / 'prefix_cache.json'}, {out / 'prefix_cache.md'}")
    failed = sum(r["summary"]["failed"] for per in data["runs"].values() for r in per.values())
    if failed:
        print(f"\n!!! {failed} REQUESTS FAILED — these results are not a clean comparison !!!", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
