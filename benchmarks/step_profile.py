"""Where a decode step's wall time goes, host phase by host phase, at several batch sizes, CPU.

    .venv/bin/python benchmarks/step_profile.py [--model DIR] [--batches 1,8,32] [--steps 64] [--threads N]
        [--driver async|sync] [--repeats N] [--json PATH]

For each batch size B: B random prompts of engine_bench's bench.DECODE_PROMPT tokens go through the engine engine_bench
builds (its PdserveRunner: the same checkpoint, scheduler and KV sizing), a few decode steps warm up, then
`--steps` decode steps run with a StepClock (shared/engine/step_clock.py) stamping each step's phases: schedule,
inputs, metadata, model (the forward and the logits), sample, update and, with the async driver, stream_out.
Only steps that decode all B sequences count. Host time is every phase but `model`: the part of a step the CPU
spends outside the forward (Python, lists, small tensors). On CPU every op runs synchronously, so the stamps are
exact; the model's own Python dispatch is inside `model`.

Drivers: `async` steps the engine on AsyncEngine's thread while an asyncio loop receives the outputs, as a
worker does (the loop's wake-ups compete for the GIL, and `stream_out` is the hand-off to it); `sync` calls
`engine.step()` in a loop, and times each call from outside as well (`wall_ms`: the phases add up to it but for
the call itself).

Prints per batch the median of each phase, the median step, host ms and host share, and the step over the
memory floor (engine_bench's: the bytes a step must read over this host's read bandwidth); writes JSON with the host
(benchmarks/host_info.py), the load average before and after, and every step's phases.
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
from benchmarks.host_info import cpu_info, describe, load_average, read_bandwidth  # noqa: E402
from shared.engine.async_engine import AsyncEngine  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.engine.step_clock import HOST_PHASES, PHASES, StepClock, StepTimes  # noqa: E402

WARMUP_STEPS = 4


def _add(engine: Engine, tag: str, prompts: list[list[int]], steps: int) -> list[str]:
    """Greedy requests that decode `steps` tokens after their first (ignore_eos: all run the full length)."""
    params = SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    return ids


def run_sync(engine: Engine, prompts: list[list[int]], steps: int, tag: str) -> tuple[list[StepTimes], list[float]]:
    """→ (the clock's steps, each step's wall time timed around engine.step())."""
    _add(engine, tag, prompts, steps)
    clock = StepClock()
    engine.time_steps(clock)
    walls = []
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    finally:
        engine.time_steps(None)
    return clock.steps, walls


def run_async(engine: Engine, prompts: list[list[int]], steps: int, tag: str) -> tuple[list[StepTimes], list[float]]:
    """The engine on AsyncEngine's thread, its outputs received on this thread's event loop. → (the clock's
    steps, the time from each step's start to the next one's: the engine thread's whole cycle)."""
    clock = StepClock()
    starts: list[float] = []

    async def main() -> None:
        done = asyncio.Event()
        left = set()

        def on_outputs(outputs) -> None:
            for o in outputs:
                if o.finished:
                    left.discard(o.request_id)
            if not left:
                done.set()

        runner = AsyncEngine(engine, on_outputs)
        runner.start()
        try:
            # requests added and the clock handed over between two steps, on the engine thread
            def add(e: Engine) -> None:
                left.update(_add(e, tag, prompts, steps))
                e.time_steps(clock)

            await runner.call(add)
            await done.wait()
            await runner.call(lambda e: e.time_steps(None))
        finally:
            await runner.stop()

    original = clock.begin

    def begin() -> None:  # the cycle: from one step's start to the next one's
        starts.append(time.perf_counter())
        original()

    clock.begin = begin  # type: ignore[method-assign]
    asyncio.run(main())
    cycles = [b - a for a, b in zip(starts, starts[1:], strict=False)] + [float("nan")]
    return clock.steps, cycles


def summarize(batch: int, steps: list[StepTimes], walls: list[float]) -> dict:
    """The decode steps of all `batch` sequences: median and mean ms per phase, step, host time and share."""
    kept = [(s, w) for s, w in zip(steps, walls, strict=True) if s.decode_only and s.seqs == batch]
    if not kept:
        raise RuntimeError(f"batch {batch}: no step decoded all {batch} sequences")
    phases = [p for p in PHASES if any(p in s.phases for s, _ in kept)]
    per_phase = {p: [1000 * s.phases.get(p, 0.0) for s, _ in kept] for p in phases}
    totals = [1000 * s.total for s, _ in kept]
    host = [1000 * sum(s.phases.get(p, 0.0) for p in HOST_PHASES) for s, _ in kept]
    wall = [1000 * w for _, w in kept if w == w]  # the async driver's last cycle is unknown (NaN)
    return dict(
        batch=batch,
        steps=len(kept),
        phases=phases,
        median_ms={p: statistics.median(v) for p, v in per_phase.items()},
        mean_ms={p: statistics.fmean(v) for p, v in per_phase.items()},
        step_ms=statistics.median(totals),
        wall_ms=statistics.median(wall) if wall else None,
        host_ms=statistics.median(host),
        model_ms=statistics.median(per_phase.get("model", [0.0])),
        host_share=statistics.median(h / t for h, t in zip(host, totals, strict=True)),
        tok_s=batch * 1000 / statistics.median(totals),
        samples_ms=[{p: 1000 * v for p, v in s.phases.items()} for s, _ in kept],
    )


def profile(runner: bench.PdserveRunner, batches: list[int], steps: int, driver: str, repeats: int, seed: int = 0):
    engine = runner.engine
    gen = torch.Generator().manual_seed(seed)
    run = run_async if driver == "async" else run_sync
    rows = []
    for batch in batches:
        prompts = bench.random_prompts(gen, batch, bench.DECODE_PROMPT, engine.model.config.vocab_size)
        runner.decode(prompts, WARMUP_STEPS)  # kernels and allocations are per shape
        all_steps: list[StepTimes] = []
        all_walls: list[float] = []
        for r in range(repeats):
            s, w = run(engine, prompts, steps, f"profile-{batch}-{r}")
            all_steps += s
            all_walls += w
        rows.append(summarize(batch, all_steps, all_walls))
    return rows


def print_report(cfg: dict, rows: list[dict]) -> None:
    context = f"{bench.DECODE_PROMPT}..{bench.DECODE_PROMPT + cfg['steps']}"
    print(f"\nstep profile | {cfg['driver']} driver | torch {cfg['torch']} | {cfg['model_type']} "
          f"{cfg['params'] / 1e6:.1f}M params\n{describe(cfg)}\nload average {cfg['load_before'][0]:.2f} before, "
          f"{cfg['load_after'][0]:.2f} after; read bandwidth {cfg['read_gbps']:.1f} GB/s\n"
          f"median ms per phase of {cfg['steps']} decode steps x {cfg['repeats']} (context {context})\n")  # fmt: skip
    phases = [p for p in PHASES if any(p in r["median_ms"] for r in rows)]
    head = "".join(f"{p:>11}" for p in phases)
    print(f"{'batch':>5}{head}{'step':>9}{'host':>8}{'host %':>8}{'tok/s':>9}{'x floor':>9}")
    for r in rows:
        cells = "".join(f"{r['median_ms'].get(p, 0.0):>11.3f}" for p in phases)
        print(f"{r['batch']:>5}{cells}{r['step_ms']:>9.2f}{r['host_ms']:>8.2f}{100 * r['host_share']:>7.1f}%"
              f"{r['tok_s']:>9.1f}{r['x_mem_floor']:>9.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small qwen3_moe demo, generated once)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=64, help=f"timed decode steps per run (at most {bench.DECODE_TOKENS})")
    ap.add_argument("--repeats", type=int, default=1, help="runs of --steps steps per batch size")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--driver", choices=("async", "sync"), default="async")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "step_profile.json"))
    args = ap.parse_args(argv)
    if not 1 <= args.steps <= bench.DECODE_TOKENS:
        ap.error(f"--steps must be in 1..{bench.DECODE_TOKENS} (the engine's KV is sized for that)")
    torch.set_num_threads(args.threads)
    load_before = load_average()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = bench.prepare_model(args.model)
    runner = bench.PdserveRunner(model_dir, prefill_batch=1, decode_batch=max(batches))
    model = runner.engine.model
    t0 = time.perf_counter()
    rows = profile(runner, batches, args.steps, args.driver, args.repeats)
    gbps = read_bandwidth(repeats=5)
    for row in rows:  # the bytes a step must read over this host's read rate (engine_bench's floor)
        read, _ = bench.decode_step_cost(model, row["batch"], bench.DECODE_PROMPT + (args.steps + 1) / 2)
        row |= dict(mem_floor_ms=read / gbps / 1e6, x_mem_floor=row["step_ms"] * gbps * 1e6 / read)
    cfg = cpu_info() | dict(
        model_dir=str(model_dir),
        model_type=model.config.model_type,
        params=sum(p.numel() for p in model.parameters()),
        torch=torch.__version__,
        driver=args.driver,
        steps=args.steps,
        repeats=args.repeats,
        prompt_len=bench.DECODE_PROMPT,
        phases=list(PHASES),
        host_phases=list(HOST_PHASES),
        read_gbps=gbps,
        bench_seconds=time.perf_counter() - t0,
        load_before=load_before,
        load_after=load_average(),
    )
    print_report(cfg, rows)
    report = dict(timestamp=datetime.now(UTC).isoformat(timespec="seconds"), config=cfg, batches=rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
