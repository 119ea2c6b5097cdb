"""What penalties, filters and logprobs add to one sampling step, on the logits' device.

    .venv/bin/python benchmarks/sampling_overhead.py [--rows 64] [--vocab 151936] [--history 1024] [--iters 20]
        [--device cpu] [--out benchmarks/results/sampling_overhead.json]

One step's (rows, vocab) float32 logits through Sampler.sample_with_logprobs with every row using the same
variant; prints the median milliseconds per step of each variant and writes them, with the CPU model, as JSON.
Histories (prompt and output ids for the penalties) have --history tokens per row, half prompt, half output.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from shared.engine.sampling import Sampler, SamplingParams

VARIANTS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+logprobs5": SamplingParams(temperature=0.0, logprobs=5),
    "greedy+penalties": SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),  # fmt: skip
    "greedy+logit_bias8": SamplingParams(temperature=0.0, logit_bias=tuple((i * 97, 1.0) for i in range(8))),
    "top_p0.9+seed": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "top_p0.9+min_p0.05+seed": SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=1),
    "all+logprobs20": SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=20,
    ),  # fmt: skip
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/sampling_overhead.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(args.device)
    half = args.history // 2
    ids = torch.randint(0, args.vocab, (args.rows, 2 * half), generator=gen).tolist()
    histories = [(row[:half], row[half:]) for row in ids]
    sampler = Sampler(0)
    results = {}
    for name, params in VARIANTS.items():
        rows = [params] * args.rows
        positions = [half] * args.rows
        sampler.sample_with_logprobs(logits, rows, positions, histories)  # warm-up
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            sampler.sample_with_logprobs(logits, rows, positions, histories)
            times.append((time.perf_counter() - start) * 1000)
        results[name] = round(statistics.median(times), 3)
        print(f"{name:28s} {results[name]:9.3f} ms/step")
    report = {"cpu": cpu_model(), "threads": torch.get_num_threads(), **vars(args), "median_ms_per_step": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"cpu: {report['cpu']}, torch threads {report['threads']}; wrote {args.out}")


if __name__ == "__main__":
    main()
