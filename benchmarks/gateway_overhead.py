"""What the serving plane adds to time to first token: TTFT through gateway + NATS + worker, against the
engine's own prefill time for the same short prompt, measured in one run.

    .venv/bin/python benchmarks/gateway_overhead.py [--model DIR] [--requests N] [--prompt-tokens N]

Stacks are real processes (`pdserve up`'s launcher): disaggregated (1 prefill + 1 decode) and mixed.
Requests are sequential (no queueing), streaming, max_tokens=1; TTFT = time from sending the request to
the first SSE chunk with a token. Engine prefill = one `Engine.step()` on the same prompt in this process,
with the same thread count as each worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch

from services.demo_model import ensure_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def engine_prefill_ms(model: Path, prompt: list[int], repeats: int) -> list[float]:
    engine = Engine.from_dir(model, max_model_len=2048)
    times = []
    for i in range(repeats + 1):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    return times[1:]  # the first includes one-time warm-up


def gateway_ttft_ms(url: str, model_name: str, prompt: list[int], repeats: int) -> list[float]:
    body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                first = None
                for line in resp.iter_lines():  # read to the end: the next request starts on an idle stack
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter()
                times.append((first - t0) * 1000)
    return times[1:]


def summarize(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=100)
    return {"p50_ms": statistics.median(samples), "p90_ms": q[89], "mean_ms": statistics.fmean(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny qwen3_moe demo, written once)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gateway_overhead.json"))
    args = ap.parse_args()
    model = Path(args.model) if args.model else ensure_demo_checkpoint(REPO / "models" / "demo-tiny-qwen3_moe")
    torch.set_num_threads(1)  # as each worker below
    prompt = torch.randint(0, 256, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    rows = {"engine_prefill": summarize(engine_prefill_ms(model, prompt, args.requests))}
    for name, topology in (
        ("disaggregated_1p1d", dict(prefill=1, decode=1)),
        ("mixed_1", dict(mixed=1, prefill=0, decode=0)),
    ):
        stack = Stack(StackSpec(model=str(model), port=free_port(), threads_per_worker=1, **topology)).start()
        try:
            rows[name] = summarize(gateway_ttft_ms(stack.url, model.name, prompt, args.requests))
        finally:
            stack.stop()
    base = rows["engine_prefill"]["p50_ms"]
    print(f"\nTTFT, {args.prompt_tokens}-token prompt, {args.requests} sequential requests, model {model.name}")
    print(f"{'path':<22}{'p50 ms':>9}{'p90 ms':>9}{'p50 added ms':>14}")
    for name, r in rows.items():
        print(f"{name:<22}{r['p50_ms']:>9.2f}{r['p90_ms']:>9.2f}{r['p50_ms'] - base:>14.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"timestamp": stamp, "prompt_tokens": args.prompt_tokens, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
