"""A worker's decode step under another process's CPU bursts on its cores: what the serving plane's CPU does to
an engine of several threads (services/planning/cpu_share.py's question).

    .venv/bin/python benchmarks/plane_burner.py [--threads 2] [--batch 8] [--duties 0,0.05,0.1,0.2] [--burners 1]
        [--period-ms 10] [--rounds 3] [--json PATH]

`pdserve profile`'s engine of the `small` demo (--threads torch threads, pinned to the first cores) decodes --batch
imported requests at context 320 (each sampled apart, as the profile does); per round and per duty, --burners
processes on the same cores each spin for duty × period and sleep the rest of every --period-ms (a duty of 0.2
with one burner: 0.2 of a core in bursts of 2 ms), while 38 decode steps are timed. Prints each round's median,
mean and p90 step per duty; the ratio to duty 0 is the slowdown the bursts cost.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.host_info import cpu_info  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.planning.profile import QUICK, ProfileRequest, profiled_engine, random_prompt  # noqa: E402
from services.planning.profile_file import WorkerConfig  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402

CONTEXT, STEPS, WARMUP = 320, 40, 2


def burn(duty: float, period_s: float, cores: list[int], stop) -> None:
    os.sched_setaffinity(0, cores)
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * period_s:
            pass
        time.sleep(period_s * (1 - duty))


def decode_steps(engine, prompt: list[int], first: list[int], kv, batch: int, tag: str) -> list[float]:
    """`batch` copies of the imported request, decoded STEPS steps; the timed steps' milliseconds."""
    for i in range(batch):
        params = SamplingParams(max_tokens=STEPS, temperature=1.0, seed=i, ignore_eos=True)
        engine.import_kv(f"{tag}-{i}", prompt, first, params, kv)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[WARMUP:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--duties", default="0,0.05,0.1,0.2")
    ap.add_argument("--burners", type=int, default=1)
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/plane_burner.json")
    args = ap.parse_args()
    duties = [float(d) for d in args.duties.split(",")]
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    model = str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    config = WorkerConfig(args.threads)
    os.sched_setaffinity(0, cores)
    rows = []
    with profiled_engine(ProfileRequest(model=model, configs=(config,), grid=QUICK), config) as engine:
        prompt = random_prompt(torch.Generator().manual_seed(1), CONTEXT, engine.model.config.vocab_size)
        engine.add_request("src", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                           hold_kv=True)  # fmt: skip
        first = [t for out in engine.step() for t in out.new_token_ids]
        while engine.has_unfinished():
            first += [t for out in engine.step() for t in out.new_token_ids]
        kv = engine.export_kv("src")
        engine.release_kv("src")
        decode_steps(engine, prompt, first, kv, args.batch, "warm")
        for r in range(args.rounds):
            for duty in duties:
                stop = mp.Event()
                burners = [mp.Process(target=burn, args=(duty, args.period_ms / 1e3, cores, stop))
                           for _ in range(args.burners if duty > 0 else 0)]  # fmt: skip
                for p in burners:
                    p.start()
                time.sleep(0.2)
                steps = decode_steps(engine, prompt, first, kv, args.batch, f"r{r}-{duty}")
                stop.set()
                for p in burners:
                    p.join()
                row = dict(round=r, duty=duty, median_ms=statistics.median(steps), mean_ms=statistics.fmean(steps),
                           p90_ms=sorted(steps)[int(0.9 * len(steps))])  # fmt: skip
                rows.append(row)
                print(f"round {r} duty {duty:.2f} x {args.burners}: median {row['median_ms']:6.2f} mean "
                      f"{row['mean_ms']:6.2f} p90 {row['p90_ms']:6.2f} ms", flush=True)  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(host=cpu_info(), args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
