"""A workload whose mix changes over time, served by every static split of the same workers and by the SLO planner
with role switching: the same requests for each (issue 38's measurement; docs/benchmarks.md, "The SLO planner
against static splits").

Each phase is NAME:SECONDS:RATE:INPUT:OUTPUT (Poisson arrivals at RATE req/s of INPUT-token prompts asking for
exactly OUTPUT tokens). The default is prefill-heavy (long prompts, short answers), then decode-heavy (short
prompts, long answers), then prefill-heavy again. Every configuration gets the same W workers of one thread each on
the same cores; the static ones are every split P + D = W with one of each role at least, the planner starts from
--planner-start and switches roles as it sees fit. Goodput: the requests that met both SLOs (TTFT and TPOT), per
second of the run. Writes JSON (every request, the planner's decisions and switches) and a plot of TTFT and TPOT
over time with the switches marked.

    .venv/bin/python benchmarks/planner_phases.py --out planner_phases.json --plot docs/img/planner_phases.png
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.bench.arrivals import arrivals_until  # noqa: E402
from services.bench.datasets import BenchRequest, random_requests  # noqa: E402
from services.bench.runner import BenchConfig, run  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from shared.model.tokenizer import Tokenizer  # noqa: E402

DEFAULT_PHASES = "prefill:100:0.8:1024:16,decode:50:3:64:256,prefill:100:0.8:1024:16"


def parse_phases(text: str) -> list[tuple[str, float, float, int, int]]:
    phases = []
    for part in text.split(","):
        name, seconds, rate, n_in, n_out = part.split(":")
        phases.append((name, float(seconds), float(rate), int(n_in), int(n_out)))
    return phases


def phase_requests(tok: Tokenizer, phases, seed: int) -> list[BenchRequest]:
    """Every phase's requests, each at its fixed send time (the same for every configuration)."""
    rng = np.random.default_rng(seed)
    requests: list[BenchRequest] = []
    start = 0.0
    for k, (name, seconds, rate, n_in, n_out) in enumerate(phases):
        times = arrivals_until(seconds, rate, 1.0, rng)
        made = random_requests(tok, max(len(times), 1), n_in, n_out, seed=seed + k, kind=name)
        requests += [BenchRequest(r.prompt, r.prompt_len, r.output_len, f"{k}:{name}", start + t)
                     for r, t in zip(made, times, strict=False)]  # fmt: skip
        start += seconds
    return requests


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def serve(
    name: str, spec: StackSpec, tok: Tokenizer, requests: list[BenchRequest], model_name: str, slos: dict, seed: int
) -> dict:
    stack = Stack(spec, log_dir=None)
    stack.start(ready_timeout_s=300)
    try:
        url = stack.url
        # short and few: wakes every code path without giving the planner a load to act on before the clock starts
        warm = [BenchRequest(r.prompt, r.prompt_len, 4, "warmup", 0.0) for r in random_requests(tok, 2, 16, 4)]
        run(BenchConfig(base_url=url, model=model_name, progress=False, timeout_s=300), warm)
        wall_start = time.time()
        config = BenchConfig(base_url=url, model=model_name, goodput_slos=slos, seed=seed, progress=False,
                             timeout_s=600)  # fmt: skip
        result = run(config, requests)
        plan = get_json(f"http://{spec.host}:{stack.planner_port}/plan") if spec.planner else None
    finally:
        stack.stop()
    records = [
        {"kind": r.kind, "start_s": r.start_s, "success": r.success, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
         "output_tokens": r.output_tokens, "error": r.error[:200]}
        for r in result.records
    ]  # fmt: skip
    good = [
        r for r in result.records if r.success and r.ttft_s * 1e3 <= slos["ttft"] and r.tpot_s * 1e3 <= slos["tpot"]
    ]
    by_phase: dict[str, dict] = {}
    for r in result.records:
        p = by_phase.setdefault(r.kind, {"requests": 0, "good": 0, "failed": 0})
        p["requests"] += 1
        p["failed"] += not r.success
    for r in good:
        by_phase[r.kind]["good"] += 1
    switches = []
    if plan is not None:
        switches = [dict(s, t_s=s["at"] - wall_start) for s in plan["switches"]]
    out = {
        "config": name,
        "duration_s": result.duration_s,
        "requests": len(result.records),
        "good": len(good),
        "failed": sum(not r.success for r in result.records),
        "goodput_rps": len(good) / result.duration_s,
        "by_phase": by_phase,
        "records": records,
        "switches": switches,
        "plan_history": plan["history"] if plan else [],
    }
    print(f"{name}: {len(good)}/{len(records)} good, goodput {out['goodput_rps']:.3f} req/s, "
          f"failed {out['failed']}, by phase {by_phase}, switches {len(switches)}", flush=True)  # fmt: skip
    return out


def plot(runs: list[dict], phases, slos: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 2.6 * len(runs)), sharex=True, squeeze=False)
    for row, run_ in zip(axes, runs, strict=True):
        ok = [r for r in run_["records"] if r["success"]]
        for ax, key, slo, label in (
            (row[0], "ttft_s", slos["ttft"], "TTFT (s)"),
            (row[1], "tpot_s", slos["tpot"], "TPOT (ms)"),
        ):
            scale = 1.0 if key == "ttft_s" else 1e3
            ax.scatter([r["start_s"] for r in ok], [r[key] * scale for r in ok], s=6)
            ax.axhline(slo / 1e3 * scale, color="red", lw=0.8, ls="--")
            ax.set_ylabel(label)
            ax.set_yscale("log")
            start = 0.0
            for _, seconds, *_ in phases:
                start += seconds
                ax.axvline(start, color="grey", lw=0.6)
            for s in run_["switches"]:
                ax.axvline(s["t_s"], color="green", lw=1.2)
                ax.text(s["t_s"], ax.get_ylim()[1], f"→{s['to']}", fontsize=7, color="green", va="top")
        row[0].set_title(f"{run_['config']}: goodput {run_['goodput_rps']:.2f} req/s", fontsize=9, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("request sent at (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small demo model, written if missing)")
    ap.add_argument("--size", default="small")
    ap.add_argument("--phases", default=DEFAULT_PHASES)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--planner-start", default="1:2", help="P:D the planner's run starts from")
    ap.add_argument("--splits", help="the static splits to run, P:D comma-separated (default: every one)")
    ap.add_argument("--ttft-ms", type=float, default=5000.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--planner-args", default="--interval-s 2 --confirm-intervals 2 --cooldown-s 10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="planner_phases.json")
    ap.add_argument("--plot")
    args = ap.parse_args()

    model = Path(args.model) if args.model else ensure_demo_checkpoint(
        REPO / "models" / f"demo-{args.size}-qwen3_moe", size=args.size)  # fmt: skip
    tok = Tokenizer(model)
    phases = parse_phases(args.phases)
    requests = phase_requests(tok, phases, args.seed)
    slos = {"ttft": args.ttft_ms, "tpot": args.tpot_ms}
    splits = ([tuple(map(int, s.split(":"))) for s in args.splits.split(",")] if args.splits
              else [(p, args.workers - p) for p in range(1, args.workers)])  # fmt: skip
    base = {"model": str(model), "port": free_port(), "threads_per_worker": 1}
    model_name = model.name
    runs = []
    for p, d in splits:
        runs.append(serve(f"static {p}P+{d}D", StackSpec(prefill=p, decode=d, **base), tok, requests, model_name, slos,
                          args.seed))  # fmt: skip
    p0, d0 = map(int, args.planner_start.split(":"))
    planner_flags = ("--ttft-slo-ms", str(args.ttft_ms), "--tpot-slo-ms", str(args.tpot_ms), *args.planner_args.split())
    runs.append(serve(f"planner from {p0}P+{d0}D", StackSpec(prefill=p0, decode=d0, planner=True,
                      planner_args=planner_flags, **base), tok, requests, model_name, slos, args.seed))  # fmt: skip
    best_static = max(runs[:-1], key=lambda r: r["goodput_rps"])
    ratio = runs[-1]["goodput_rps"] / best_static["goodput_rps"] if best_static["goodput_rps"] else None
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    data = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": len(__import__("os").sched_getaffinity(0)),
        "phases": args.phases,
        "workers": args.workers,
        "slos_ms": slos,
        "planner_args": args.planner_args,
        "runs": runs,
        "best_static": best_static["config"],
        "planner_over_best_static": ratio,
    }
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"planner / best static ({best_static['config']}): {ratio if ratio is None else round(ratio, 3)}  "
          f"[{cpu}]; wrote {args.out}")  # fmt: skip
    if args.plot:
        plot(runs, phases, slos, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
