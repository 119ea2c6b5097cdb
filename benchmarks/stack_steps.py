"""A worker's engine steps in a running stack against the profile's steps of the same shape: are decode steps in
a deployment as cheap as `pdserve profile` says?

    .venv/bin/python benchmarks/stack_steps.py --profile PROFILE.json [--role mixed|decode] [--threads 2]
        [--rate 4] [--requests 120] [--json PATH]

Starts a local stack (private NATS and Redis, the gateway) with one worker of the role (`mixed`, or `decode`
behind a 1-core prefill worker), `--threads` torch threads pinned to the first cores, prefix caching off, and
sends the plan check's workload (Poisson `--rate`, prompts 128–384, outputs 64–192 tokens). Once it runs, the
worker's heartbeats are read for a while: each carries the worker's own decode-only step time
(`PathCalibration.decode_step_ms`, timed inside `Engine.step`, an average of the last steps) and its running
requests. Each reading is printed against the profile's decode step for that many sequences at context 320 (the
workload's mean), from the profile's configuration of `--threads` cores; the ratio says how much dearer a step is
in the stack. `running` counts requests still prefilling too, so the profile's figure is for at least as many
decoding sequences as the step had: the ratio is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.host_info import cpu_info  # noqa: E402
from services.bench.datasets import BenchRequest  # noqa: E402
from services.bench.prompts import PromptMaker  # noqa: E402
from services.bench.runner import BenchConfig, run  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.local.cluster_state import heartbeats  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.proc_cpu import cpu_seconds  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from services.planning.costs import WorkerCosts  # noqa: E402
from services.planning.plane import stack_model_name  # noqa: E402
from services.planning.profile_file import load_profile  # noqa: E402
from shared.model.tokenizer import Tokenizer  # noqa: E402

CONTEXT = 320  # the workload's mean context while decoding
CHUNK = 256  # prompt tokens of the mixed step compared (the workload's mean prompt)


def spec(model: str, role: str, threads: int) -> StackSpec:
    cores = tuple(range(threads))
    if role == "mixed":
        return StackSpec(model=model, port=free_port(), prefill=0, decode=0, mixed=1, threads={"mixed": threads},
                         cpu_affinity={"mixed": cores}, worker_args=("--no-prefix-caching",))  # fmt: skip
    last = max(os.sched_getaffinity(0))
    return StackSpec(model=model, port=free_port(), prefill=1, decode=1, threads={"prefill": 1, "decode": threads},
                     cpu_affinity={"prefill": (last,), "decode": cores}, worker_args=("--no-prefix-caching",),
                     env={"PDSERVE_PREFILL_PATH": "remote"})  # fmt: skip


def cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each process of the stack and of this one (the load's client)."""
    return stack.cpu_seconds() | {"client": cpu_seconds(os.getpid())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a `pdserve profile` file of the same model and host")
    ap.add_argument("--model", help="checkpoint (default: the small qwen3_moe demo)")
    ap.add_argument("--role", choices=["mixed", "decode"], default="mixed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--readings", type=int, default=6, help="heartbeat windows of 2 s each")
    ap.add_argument("--json", default="benchmarks/results/stack_steps.json")
    args = ap.parse_args()
    model = args.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    profile = load_profile(args.profile)
    config = next(c for c in profile.configs if c.config.units == args.threads and c.config.ranks == 1)
    costs = WorkerCosts.of(config, profile.engine.max_num_batched_tokens)
    stack = Stack(spec(model, args.role, args.threads))
    stack.start(ready_timeout_s=300)
    readings = []
    try:
        maker, rng = PromptMaker(Tokenizer(model)), np.random.default_rng(0)
        name = stack_model_name(model)
        run(BenchConfig(base_url=stack.url, model=name, progress=False, timeout_s=300),
            [BenchRequest(*maker.make(64, rng), 8) for _ in range(2)])  # fmt: skip  # warm-up
        requests = [BenchRequest(*maker.make(int(rng.integers(128, 385)), rng), int(rng.integers(64, 193)))
                    for _ in range(args.requests)]  # fmt: skip
        load = BenchConfig(base_url=stack.url, model=name, progress=False, timeout_s=300, request_rate=args.rate)
        sender = threading.Thread(target=run, args=(load, requests))
        sender.start()
        time.sleep(8)  # past the first arrivals
        cpu0, t0 = cpu_s(stack), time.perf_counter()
        for _ in range(args.readings):
            for beat in heartbeats(stack.nats_url, 2.0).values():
                cal = beat.path_calibration
                if beat.role.value == args.role and cal is not None and cal.decode_step_ms and beat.running:
                    profiled = costs.decode.step_s(beat.running, CONTEXT) * 1e3
                    reading = dict(running=beat.running, stack_ms=cal.decode_step_ms, profile_ms=profiled)
                    line = f"running {beat.running:3d}: decode step in the stack {cal.decode_step_ms:6.1f} ms, " \
                        f"profile {profiled:6.1f} ms, ratio {cal.decode_step_ms / profiled:.2f}"  # fmt: skip
                    if cal.prefill_tokens_per_s and cal.prefill_step_ms is not None:
                        # a step that computed CHUNK prompt tokens, by the worker's own fitted line and by the
                        # planner's sum (the batch's decode step + the chunk's work; on a decode worker, none)
                        stack_chunk = cal.prefill_step_ms + CHUNK / cal.prefill_tokens_per_s * 1e3
                        decoding = profiled if args.role == "mixed" else 0.0
                        profile_chunk = decoding + costs.prefill.step_s * 1e3 + costs.prefill.chunk_s(0, CHUNK) * 1e3
                        reading.update(stack_chunk_ms=stack_chunk, profile_chunk_ms=profile_chunk)
                        line += f"; a step with {CHUNK} prompt tokens {stack_chunk:6.1f} ms, profile " \
                            f"{profile_chunk:6.1f} ms, ratio {stack_chunk / profile_chunk:.2f}"  # fmt: skip
                    readings.append(reading)
                    print(line, flush=True)
        cpu1, t1 = cpu_s(stack), time.perf_counter()
        cores = {name: round((cpu1[name] - cpu0.get(name, 0.0)) / (t1 - t0), 3) for name in cpu1}
        print("CPU while read (cores): " + ", ".join(f"{n} {c:.2f}" for n, c in cores.items()), flush=True)
        sender.join()
    finally:
        stack.stop()
    ratios = [r["stack_ms"] / r["profile_ms"] for r in readings]
    if ratios:
        print(f"{args.role}, {args.threads} threads: stack / profile median {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}), load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    chunks = [r["stack_chunk_ms"] / r["profile_chunk_ms"] for r in readings if "stack_chunk_ms" in r]
    if chunks:
        print(f"a step with {CHUNK} prompt tokens: stack / profile median {statistics.median(chunks):.2f} "
              f"({min(chunks):.2f}-{max(chunks):.2f})")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(host=cpu_info(), args=vars(args), readings=readings, cores=cores), indent=2))


if __name__ == "__main__":
    main()
