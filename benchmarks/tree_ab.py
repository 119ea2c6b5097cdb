"""Two checkouts of pdserve decoding side by side in one process: what a change of the code buys a step, CPU.

    .venv/bin/python benchmarks/tree_ab.py --old DIR [--new DIR] [--batch 1,8] [--threads 1,2] [--rounds 15]
        [--steps 20] [--prefill TOKENS] [--json OUT]

`--old` and `--new` are source trees (a `git worktree` or `git archive` of each commit; `--new` defaults to this
one). Each tree's packages are imported in turn under their own names (`shared`, `services`, `benchmarks`): once the
first tree's are imported they are dropped from `sys.modules` (its classes keep their own modules) and the second
tree's are imported, so both engines live in one process, each running its own code (and its own build of the C
kernels, cached by a hash of their source). A module either tree imported only inside a function would resolve to
the new tree's: the CPU decode path imports nothing that way (only the Triton kernels do). Per thread count and
batch size B, both engines prefill the same B random 128-token prompts, warm up, then run `--rounds` rounds of
`--steps` greedy decode steps each, the two engines taking turns within every round (the order alternating), so both
see the same host, the same load and the same growing contexts. Prints per engine the median step and its multiple
of the step's memory floor (bytes over the read bandwidth sampled in the same rounds), the paired ratio (median over
rounds of new / old), the aten op calls of one decode step (torch.profiler, all nested calls counted, and the top-
level ones), and whether the two produced the same greedy tokens; records the CPU model and the load average before
and after. `--prefill N` also times one fresh N-token prompt's prefill step per side per round, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent.parent
PROMPT = 128
TREE_PACKAGES = ("shared", "services", "benchmarks")


def import_tree(tree: Path) -> dict:
    """The entry points of `tree`'s code, imported fresh (the previous tree's modules dropped first)."""
    for name in [m for m in sys.modules if m.split(".")[0] in TREE_PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        from benchmarks.engine_bench import decode_step_cost
        from benchmarks.host_info import read_bandwidth
        from services.demo_model import ensure_demo_checkpoint
        from shared.engine.config import SchedulerConfig
        from shared.engine.engine import Engine
        from shared.engine.sampling import SamplingParams
    finally:
        sys.path.remove(str(tree))
    return dict(
        Engine=Engine,
        SchedulerConfig=SchedulerConfig,
        SamplingParams=SamplingParams,
        checkpoint=ensure_demo_checkpoint,
        step_cost=decode_step_cost,
        read_bandwidth=read_bandwidth,
    )


class Side:
    """One tree's engine, stepping B greedy requests."""

    def __init__(self, name: str, code: dict, model_dir: Path, batch: int, tokens: int, prompt: int = PROMPT) -> None:
        """B sequences of `prompt` + `tokens` tokens at most, each prompt prefilled in one step."""
        self.name, self.times, self.tokens = name, [], {}
        self.engine = code["Engine"].from_dir(
            model_dir,
            scheduler=code["SchedulerConfig"](max_num_batched_tokens=batch * prompt, max_num_seqs=batch),
            num_kv_blocks=batch * -(-(prompt + tokens + 1) // 16),
            max_model_len=prompt + tokens + 1,
            enable_prefix_caching=False,
        )
        self.params = code["SamplingParams"](max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def start(self, prompts: list[list[int]], warmup: int) -> None:
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"r{i}", prompt, self.params)
        for _ in range(warmup + 1):  # the prefill, then warm-up decode steps
            self._step()

    def _step(self) -> None:
        for out in self.engine.step():
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    def run(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self._step()
            times.append(time.perf_counter() - t0)
        self.times.extend(times)
        return times

    def op_calls(self) -> tuple[int, int]:
        """(aten op calls of one decode step, nested ones included; the top-level ones)."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self._step()
        events = prof.events() or []
        return len(events), sum(1 for e in events if e.cpu_parent is None)


def bench(sides: list[Side], prompts, rounds: int, steps: int, code: dict) -> dict:
    """Rounds of `steps` steps per side, the order alternating; the host's read bandwidth sampled once a round
    between the two sides' runs, for the memory floor: the bytes a step must read (engine_bench.py's
    decode_step_cost: the weights of the experts it touches, the KV) over the median of those samples."""
    for side in sides:
        side.start(prompts, warmup=8)
    ops = {side.name: side.op_calls() for side in sides}
    ratios, gbps = [], []
    for r in range(rounds):
        first, second = sides if r % 2 == 0 else sides[::-1]
        medians = {first.name: statistics.median(first.run(steps))}
        gbps.append(code["read_bandwidth"](repeats=5))
        medians[second.name] = statistics.median(second.run(steps))
        ratios.append(medians["new"] / medians["old"])
    old, new = sides
    same = sum(old.tokens[k] == new.tokens.get(k) for k in old.tokens) / len(old.tokens)
    context = PROMPT + 9 + rounds * steps / 2  # the timed steps' average context
    read, _ = code["step_cost"](new.engine.model, len(prompts), context)
    floor_ms = read / statistics.median(gbps) / 1e6
    old_ms, new_ms = 1000 * statistics.median(old.times), 1000 * statistics.median(new.times)
    return dict(
        old_step_ms=old_ms,
        new_step_ms=new_ms,
        paired_ratio=statistics.median(ratios),
        ratio_range=(min(ratios), max(ratios)),
        old_ops=ops["old"],
        new_ops=ops["new"],
        same_tokens=same,
        step_mb=read / 1e6,
        read_gbps=statistics.median(gbps),
        mem_floor_ms=floor_ms,
        old_x_floor=old_ms / floor_ms,
        new_x_floor=new_ms / floor_ms,
    )


def bench_prefill(codes: dict, model_dir: Path, length: int, rounds: int) -> dict:
    """One fresh `length`-token prompt per side per round (max_tokens=1, prefix cache off): the prefill step's
    time, the two sides alternating."""
    sides = [Side(name, codes[name], model_dir, 1, 1, prompt=length) for name in ("old", "new")]
    gen = torch.Generator().manual_seed(length)
    times: dict[str, list[float]] = {"old": [], "new": []}
    ratios = []
    for r in range(rounds + 1):  # the first round warms up
        prompt = torch.randint(0, 259, (length,), generator=gen).tolist()
        taken = {}
        for side in sides if r % 2 == 0 else sides[::-1]:
            side.engine.add_request(f"p{r}", prompt, side.params)
            t0 = time.perf_counter()
            side.engine.step()
            taken[side.name] = time.perf_counter() - t0
        if r:
            ratios.append(taken["new"] / taken["old"])
            for name, t in taken.items():
                times[name].append(t)
    return dict(
        old_ms=1000 * statistics.median(times["old"]),
        new_ms=1000 * statistics.median(times["new"]),
        paired_ratio=statistics.median(ratios),
        ratio_range=(min(ratios), max(ratios)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="the baseline tree")
    ap.add_argument("--new", type=Path, default=HERE, help="the changed tree (default: this one)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="decode steps per engine per round")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prefill of this many tokens per round")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    codes = {"old": import_tree(args.old.resolve()), "new": import_tree(args.new.resolve())}
    model_dir = codes["new"]["checkpoint"](HERE / "models" / "demo-small-qwen3_moe", size="small")
    tokens = 8 + 2 + args.rounds * args.steps
    rows = []
    print(f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}; old {args.old}, new {args.new}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for batch in (int(b) for b in args.batch.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, 259, (batch, PROMPT), generator=gen).tolist()
            load_before = os.getloadavg()
            sides = [Side(name, codes[name], model_dir, batch, tokens) for name in ("old", "new")]
            row: dict[str, Any] = dict(threads=threads, batch=batch, load_before=load_before)
            row |= bench(sides, prompts, args.rounds, args.steps, codes["new"])
            row["load_after"] = os.getloadavg()
            rows.append(row)
            print(f"threads {threads} batch {batch:3d}: old {row['old_step_ms']:.2f} ms, new {row['new_step_ms']:.2f}"
                  f" ms, paired new/old {row['paired_ratio']:.3f} ({row['ratio_range'][0]:.2f}-"
                  f"{row['ratio_range'][1]:.2f}); x mem floor ({row['mem_floor_ms']:.2f} ms at "
                  f"{row['read_gbps']:.0f} GB/s) old {row['old_x_floor']:.2f} new {row['new_x_floor']:.2f}; "
                  f"aten ops/step old {row['old_ops'][0]} ({row['old_ops'][1]} "
                  f"top-level), new {row['new_ops'][0]} ({row['new_ops'][1]}); same tokens {row['same_tokens']:.0%};"
                  f" load {load_before[0]:.1f} -> {row['load_after'][0]:.1f}", flush=True)  # fmt: skip
            del sides
        if args.prefill:
            load_before = os.getloadavg()
            row = dict(threads=threads, prefill=args.prefill, load_before=load_before)
            row |= bench_prefill(codes, model_dir, args.prefill, args.rounds)
            row["load_after"] = os.getloadavg()
            rows.append(row)
            print(
                f"threads {threads} prefill {args.prefill}: old {row['old_ms']:.1f} ms, new {row['new_ms']:.1f} ms, "
                f"paired new/old {row['paired_ratio']:.3f} ({row['ratio_range'][0]:.2f}-"
                f"{row['ratio_range'][1]:.2f}); load {load_before[0]:.1f} -> {row['load_after'][0]:.1f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(dict(cpu=cpu, old=str(args.old), new=str(args.new), rows=rows), indent=2))


if __name__ == "__main__":
    main()
