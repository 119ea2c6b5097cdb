"""n choices of one prompt in one engine: a group (the prompt computed once, its KV shared) against n independent
requests with the same seeds, on CPU.

    .venv/bin/python benchmarks/choices_bench.py [--model DIR] [--n 4] [--prompt-len 512] [--max-tokens 32]
                                                 [--repeats 3] [--out JSON]

Per run: time to every choice's first token, total time to the end, prompt tokens the model computed, and the
KV blocks in use right after the first tokens. Both runs produce the same tokens (checked: choice i of the group
equals the independent request seeded seed + i). Medians over repeats, the two alternated. Prints a table and
writes JSON (with the CPU model).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from services.demo_model import write_demo_checkpoint
from shared.engine.engine import Engine
from shared.engine.fork import Choice, choice_params
from shared.engine.sampling import SamplingParams


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(engine: Engine, prompt: list[int], params: SamplingParams, n: int, grouped: bool) -> dict:
    ids = [f"{'g' if grouped else 's'}{time.monotonic_ns()}-{i}" for i in range(n)]
    before = engine.stats.prefill_tokens
    start = time.perf_counter()
    if grouped:
        engine.add_group(prompt, [Choice(rid, choice_params(params, i)) for i, rid in enumerate(ids)])
    else:
        for i, rid in enumerate(ids):
            engine.add_request(rid, prompt, choice_params(params, i))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first_at = blocks_at_first = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if first_at is None and all(tokens.values()):
            first_at = time.perf_counter() - start
            blocks_at_first = engine.blocks.num_blocks - engine.blocks.num_free
    engine.check_integrity()
    return {
        "first_tokens_s": first_at,
        "total_s": time.perf_counter() - start,
        "prompt_tokens_computed": engine.stats.prefill_tokens - before,
        "blocks_after_first_tokens": blocks_at_first,
        "tokens": [tokens[rid] for rid in ids],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a small random demo model)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="choices_bench.json")
    args = ap.parse_args()
    model = args.model or str(write_demo_checkpoint(Path(tempfile.mkdtemp()) / "demo", arch="qwen3_moe", size="small"))
    engine = Engine.from_dir(model, threads=args.threads, max_model_len=args.prompt_len + args.max_tokens + 16)
    prompt = [random.Random(0).randrange(10, engine.model.config.vocab_size) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    results: dict[str, list[dict]] = {"group": [], "independent": []}
    for r in range(args.repeats + 1):  # the first round warms up
        for kind in ("group", "independent") if r % 2 else ("independent", "group"):
            res = run(engine, prompt, params, args.n, grouped=kind == "group")
            if r:
                results[kind].append(res)
    same = all(g["tokens"] == s["tokens"] for g, s in zip(results["group"], results["independent"], strict=True))
    summary = {
        kind: {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "tokens"}
        for kind, runs in results.items()
    }
    report = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "model": model if args.model else "demo qwen3_moe small (random weights)",
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "identical_tokens": same,
        "median": summary,
    }
    print(f"{args.n} choices, prompt {args.prompt_len} tokens, {args.max_tokens} tokens each; CPU: {report['cpu']}")
    print(f"{'':12} {'first tokens s':>15} {'total s':>9} {'prompt tokens':>14} {'blocks':>7}")
    for kind, m in summary.items():
        print(
            f"{kind:12} {m['first_tokens_s']:>15.3f} {m['total_s']:>9.3f} {m['prompt_tokens_computed']:>14.0f} "
            f"{m['blocks_after_first_tokens']:>7.0f}"
        )
    print(f"identical tokens: {same}")
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
