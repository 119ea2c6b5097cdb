"""An engine built on the thread that will not step it, against one built on a thread that has ended: decode steps
timed from a second thread, as a worker steps its engine (AsyncEngine), each variant in a fresh process.

    .venv/bin/python benchmarks/engine_thread_pools.py [--threads 2] [--batch 10] [--context 320] [--rounds 2]

libgomp keeps an OpenMP thread pool per thread that ran a parallel region, until that thread exits; with two pools
(the building thread's and the stepping thread's) it manages more threads than the CPUs and throttles its spinning,
so the engine's kernels sleep at every barrier (shared/engine/build_thread.py). `main`: built on the main thread
(the workers before 2026-12-07); `passing`: built on a thread that then ended (on_a_passing_thread, the workers
now). Prints the median decode step of each run (ms) and writes JSON with the host and load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def child(variant: str, threads: int, batch: int, context: int) -> float:
    """One variant in this process: → the median decode step, ms."""
    from services.demo_model import ensure_demo_checkpoint
    from services.planning import profile as P
    from services.planning.profile_file import WorkerConfig
    from shared.engine.build_thread import on_a_passing_thread

    model = str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    config = WorkerConfig(units=threads)
    grid = P.Grid((), (batch,), (context,), decode_steps=16)
    context_manager = P.profiled_engine(P.ProfileRequest(model=model, configs=(config,), grid=grid), config)
    engine = context_manager.__enter__() if variant == "main" else on_a_passing_thread(context_manager.__enter__)
    steps: list[float] = []
    stepper = threading.Thread(target=lambda: steps.extend(P.measure_decode(engine, grid)[0].step_s for _ in range(3)))
    stepper.start()
    stepper.join()
    return statistics.median(steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["main", "passing"], help=argparse.SUPPRESS)
    ap.add_argument("--json", default="benchmarks/results/engine_thread_pools.json")
    args = ap.parse_args()
    if args.child:
        print(f"{child(args.child, args.threads, args.batch, args.context):.2f}")
        return
    from benchmarks.host_info import cpu_info, describe

    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {"main": [], "passing": []}
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--threads", str(args.threads),
                                  "--batch", str(args.batch), "--context", str(args.context)],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            runs[variant].append(float(out.strip().splitlines()[-1]))
            print(f"built on {variant:8s}: decode step {runs[variant][-1]:.1f} ms", flush=True)
    info = cpu_info()
    print(f"{describe(info)}; {args.threads} threads, batch {args.batch}, context {args.context}; load average "
          f"{load_before[0]:.2f} → {os.getloadavg()[0]:.2f}")  # fmt: skip
    ratio = statistics.median(runs["main"]) / statistics.median(runs["passing"])
    print(f"median step built on main / on a passing thread: {ratio:.2f}")
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(dict(host=info, args=vars(args), load_before=load_before,
                                        load_after=os.getloadavg(), runs=runs, ratio=ratio), indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
