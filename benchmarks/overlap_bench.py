"""Overlap scheduling on and off, side by side: decode tokens per second at several batch sizes, CPU.

    .venv/bin/python benchmarks/overlap_bench.py [--model DIR] [--batches 1,8,32] [--steps 64] [--repeats 5]
        [--threads N] [--driver async|sync] [--json PATH]

Two engines over the same loaded checkpoint (the `small` qwen3_moe demo engine_bench uses, prefix cache off,
engine_bench's scheduler and KV sizing), one with `overlap_scheduling` off and one with it on
(shared/engine/overlap.py). For each batch size B, each repeat runs B greedy requests of engine_bench's
DECODE_PROMPT random tokens through both engines, one after the other, the order alternating between repeats
(off first in even repeats): decode tokens per second is the tokens after the first of every request over the
time from the last request's first token to the last token. Medians over the repeats, and the median of each
repeat's on/off ratio (a pair runs back to back, so a shared host's load drifts less within it than across the
run); the greedy tokens of the two engines are checked identical.

Drivers: `async` (default) steps each engine on AsyncEngine's thread while an asyncio loop receives its
outputs, as a worker does (what the loop does between steps is what overlap hides); `sync` calls
`engine.step()` in a loop. Writes JSON with the host (benchmarks/host_info.py), the load average before and
after, the torch thread count, OMP_* variables and every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from benchmarks import engine_bench as bench  # noqa: E402
from benchmarks.host_info import cpu_info, describe, load_average  # noqa: E402
from shared.engine.async_engine import AsyncEngine  # noqa: E402
from shared.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine, RequestOutput  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.model.transformer import CausalLM  # noqa: E402

WARMUP_TOKENS = 4
Arrivals = list[tuple[float, RequestOutput]]  # (perf_counter when the output reached the driver, the output)


def make_engine(model_dir: Path, model: CausalLM, overlap: bool, batch: int, steps: int) -> Engine:
    blocks = -(-(bench.DECODE_PROMPT + steps + 2) // bench.BLOCK_SIZE) * batch
    config = EngineConfig(
        model=str(model_dir),
        overlap_scheduling=overlap,
        block_size=bench.BLOCK_SIZE,
        num_kv_blocks=blocks,  # nothing is preempted
        max_model_len=bench.DECODE_PROMPT + steps + 2,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * bench.DECODE_PROMPT),
    )
    return Engine.build(config, model=model)


def _add(engine: Engine, tag: str, prompts: list[list[int]], tokens: int) -> set[str]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = {f"{tag}-{i}" for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    return ids


def run_sync(engine: Engine, prompts: list[list[int]], tokens: int, tag: str) -> Arrivals:
    _add(engine, tag, prompts, tokens)
    arrivals: Arrivals = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        arrivals += [(now, o) for o in outs]
    return arrivals


def run_async(engine: Engine, prompts: list[list[int]], tokens: int, tag: str) -> Arrivals:
    arrivals: Arrivals = []

    async def main() -> None:
        done = asyncio.Event()
        left: set[str] = set()

        def on_outputs(outputs: list[RequestOutput]) -> None:
            now = time.perf_counter()
            for o in outputs:
                arrivals.append((now, o))
                if o.finished:
                    left.discard(o.request_id)
            if not left:
                done.set()

        runner = AsyncEngine(engine, on_outputs)
        runner.start()
        try:
            await runner.call(lambda e: left.update(_add(e, tag, prompts, tokens)))
            await done.wait()
        finally:
            await runner.stop()

    asyncio.run(main())
    return arrivals


def decode_rate(arrivals: Arrivals, batch: int) -> tuple[float, dict[str, list[int]]]:
    """(decode tokens per second, each request's tokens): the tokens after each request's first, over the time
    from the last first token to the last token."""
    tokens: dict[str, list[int]] = {}
    first_at: dict[str, float] = {}
    for t, o in arrivals:
        if o.request_id not in tokens:
            first_at[o.request_id] = t
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(tokens) == batch
    start, end = max(first_at.values()), max(t for t, _ in arrivals)
    decoded = sum(1 for t, o in arrivals if t > start for _ in o.new_token_ids)
    return decoded / (end - start), tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small qwen3_moe demo, generated once)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=64, help="decode tokens per request after its first")
    ap.add_argument("--repeats", type=int, default=5, help="pairs of runs (off and on) per batch size")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--driver", choices=("async", "sync"), default="async")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "overlap_bench.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    model_dir = bench.prepare_model(args.model)
    model = load_model(model_dir)
    run = run_async if args.driver == "async" else run_sync
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.perf_counter()
    for batch in (int(b) for b in args.batches.split(",")):
        engines = {ov: make_engine(model_dir, model, ov, batch, args.steps) for ov in (False, True)}
        prompts = bench.random_prompts(gen, batch, bench.DECODE_PROMPT, model.config.vocab_size)
        for ov, engine in engines.items():  # kernels and allocations are per shape
            run(engine, prompts, WARMUP_TOKENS, f"warm-{ov}")
        rates: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, dict[str, list[int]]] = {}
        for r in range(args.repeats):
            for ov in (False, True) if r % 2 == 0 else (True, False):
                rate, got = decode_rate(run(engines[ov], prompts, 1 + args.steps, f"r{r}"), batch)
                rates[ov].append(rate)
                tokens[ov] = {rid.split("-", 1)[1]: t for rid, t in got.items()}
        if tokens[False] != tokens[True]:
            raise RuntimeError(f"batch {batch}: overlap changed the greedy tokens")
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        paired = statistics.median(b / a for a, b in zip(rates[False], rates[True], strict=True))
        row = dict(batch=batch, off_tok_s=off, on_tok_s=on, ratio=on / off, paired_ratio=paired,
                   off_runs=rates[False], on_runs=rates[True])  # fmt: skip
        rows.append(row)
        runs = f"off {', '.join(f'{x:.0f}' for x in rates[False])}; on {', '.join(f'{x:.0f}' for x in rates[True])}"
        print(f"batch {batch:>3}: off {off:8.1f} tok/s  on {on:8.1f} tok/s  on/off {on / off:.3f}  "
              f"paired {paired:.3f}  ({runs})")  # fmt: skip
    cfg = cpu_info() | dict(
        model_dir=str(model_dir),
        model_type=model.config.model_type,
        params=sum(p.numel() for p in model.parameters()),
        torch=torch.__version__,
        threads=args.threads,
        omp_env={k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
        driver=args.driver,
        steps=args.steps,
        repeats=args.repeats,
        prompt_len=bench.DECODE_PROMPT,
        bench_seconds=time.perf_counter() - t0,
        load_before=load_before,
        load_after=load_average(),
    )
    print(f"\n{describe(cfg)}\n{args.driver} driver, {args.threads} threads, load average "
          f"{load_before[0]:.2f} before, {load_average()[0]:.2f} after")  # fmt: skip
    report = dict(timestamp=datetime.now(UTC).isoformat(timespec="seconds"), config=cfg, batches=rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
