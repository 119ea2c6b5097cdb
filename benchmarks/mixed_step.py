"""A mixed step against the planner's sum: B decoding sequences and a new prompt of P tokens in one engine step,
timed, against one decode-only step of B plus the prompt's step alone (what `pdserve plan`'s model charges a
mixed worker's step, services/planning/simulate.py).

    .venv/bin/python benchmarks/mixed_step.py [--model DIR] [--batches 4,16] [--prompts 128,384] [--rounds 3]
        [--threads 1] [--cpu 1] [--json PATH]

One engine (the `small` qwen3_moe demo unless --model; prefix cache off; `pdserve profile`'s engine), pinned to
`--cpu`. Per (B, P) and round: B copies of an imported 256-token request decode; three steps warm up; then six
steps, each with a fresh prompt of P tokens added before it (the step holds the B decodes and the prompt's first
chunk, within the 512-token budget), timed one by one; the B requests are aborted and the engine drained; then
three prompts of P alone, one step each. Medians per round, then the median of the rounds. Ratio = mixed step /
(decode-only step + prompt alone): 1.0 is the planner's sum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.host_info import cpu_info, describe  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.planning.profile import Grid, ProfileRequest, profiled_engine, random_prompt  # noqa: E402
from services.planning.profile_file import WorkerConfig  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402

CONTEXT = 256  # the decoding requests' prompt
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def measure(engine, batch: int, prompt: int, kv, src: list[int], first: list[int], gen, tag: str) -> tuple:
    """(mixed step, decode-only step, prompt alone) medians, seconds, of one round."""
    vocab = engine.model.config.vocab_size
    ids = [f"{tag}-d{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)  # apart: see profile.py
        engine.import_kv(rid, src, first, params, kv)
    for _ in range(3):
        engine.step()
    decode = statistics.median(timed_step(engine) for _ in range(6))
    mixed = []
    for k in range(6):
        engine.add_request(f"{tag}-p{k}", random_prompt(gen, prompt, vocab), ONE)
        mixed.append(timed_step(engine))
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    alone = []
    for k in range(3):
        engine.add_request(f"{tag}-a{k}", random_prompt(gen, prompt, vocab), ONE)
        alone.append(timed_step(engine))
        while engine.has_unfinished():
            engine.step()
    return statistics.median(mixed), decode, statistics.median(alone)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small qwen3_moe demo, written once)")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--prompts", default="128,384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core (default: as inherited)")
    ap.add_argument("--json", default="benchmarks/results/mixed_step.json")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, [args.cpu])
    model = args.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    config = WorkerConfig(units=args.threads)
    req = ProfileRequest(model=model, configs=(config,), grid=Grid((), (), ()))  # the engine only: no grid runs
    gen = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",")]
    load_before = os.getloadavg()
    runs: dict[tuple[int, int], list[tuple]] = {}
    with profiled_engine(req, config) as engine:
        src = random_prompt(gen, CONTEXT, engine.model.config.vocab_size)
        engine.add_request("src", src, ONE, hold_kv=True)
        first = [t for out in engine.step() for t in out.new_token_ids]
        while engine.has_unfinished():
            first += [t for out in engine.step() for t in out.new_token_ids]
        kv = engine.export_kv("src")
        engine.release_kv("src")
        for r in range(args.rounds):
            for b in batches:
                for p in prompts:
                    runs.setdefault((b, p), []).append(measure(engine, b, p, kv, src, first, gen, f"{r}-{b}-{p}"))
    info = cpu_info()
    print(f"{describe(info)}; load average {load_before[0]:.2f} → {os.getloadavg()[0]:.2f}")
    print("| batch | prompt | mixed step ms | decode step ms | prompt alone ms | mixed / sum |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for (b, p), rounds in sorted(runs.items()):
        mixed, decode, alone = (statistics.median(x[i] for x in rounds) * 1e3 for i in range(3))
        rows.append(dict(batch=b, prompt=p, mixed_ms=mixed, decode_ms=decode, alone_ms=alone,
                         ratio=mixed / (decode + alone), rounds=[list(x) for x in rounds]))  # fmt: skip
        print(f"| {b} | {p} | {mixed:.1f} | {decode:.1f} | {alone:.1f} | {mixed / (decode + alone):.2f} |")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(host=info, threads=args.threads, cpu=args.cpu, load_before=load_before,
                                   load_after=os.getloadavg(), rows=rows), indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
