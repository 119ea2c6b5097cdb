"""Tensor parallelism on one host: TP 1 with T threads against TP 2 with T/2 threads per rank, side by side.

    .venv/bin/python benchmarks/tp_bench.py [--model DIR] [--out JSON] [--threads T] [--repeats N]
        [--prefill-len N] [--decode-batch B] [--decode-tokens N]

- weight bytes per rank (`model_weight_bytes`), TP 1 and each TP 2 rank (loaded without a group: loading
  needs no collective);
- prefill: one prompt of --prefill-len tokens in one step, up to its first token (seconds);
- the same on TP 1 with T/2 threads (the control: fewer threads per process without splitting the model);
- decode: --decode-batch prompts of 64 tokens, then --decode-tokens greedy tokens each; only the steps after
  every request has its first token are timed (tokens/s).

TP 2 runs SPMD on two local gloo ranks (`run_on_ranks`: this process is rank 0); the slower rank's time
counts. Repeats alternate TP 1 and TP 2 so drift on a shared machine hits both; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.loader import load_model, model_weight_bytes  # noqa: E402
from shared.parallel.launch import run_on_ranks  # noqa: E402
from shared.sharding.group import RankGroup  # noqa: E402
from shared.sharding.layout import ParallelLayout  # noqa: E402

DECODE_PROMPT = 64


def measure(group: RankGroup | None, model: str, threads: int, args: dict) -> dict:
    """One engine (this rank's, or the whole model): prefill seconds and decode tokens/s."""
    tp = group.world if group else 1
    config = EngineConfig(
        model=model,
        tp=tp,
        threads=threads,
        max_model_len=args["prefill_len"] + 8,
        kv_cache_bytes=256 << 20,
        scheduler=SchedulerConfig(
            max_num_seqs=max(args["decode_batch"], 1), max_num_batched_tokens=args["prefill_len"]
        ),
    )
    engine = Engine.build(config, group=group)
    vocab = engine.model.config.vocab_size
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[5 + i % (vocab - 10) for i in range(32)]], first)  # warm-up
    prompt = [(7 * i) % (vocab - 10) + 3 for i in range(args["prefill_len"])]
    start = time.perf_counter()
    engine.generate([prompt], first)
    prefill_s = time.perf_counter() - start

    params = SamplingParams(max_tokens=args["decode_tokens"] + 1, temperature=0.0, ignore_eos=True)
    for b in range(args["decode_batch"]):
        engine.add_request(f"d{b}", [(b * 13 + i) % (vocab - 10) + 3 for i in range(DECODE_PROMPT)], params)
    while not all(r.output_token_ids for r in engine.requests.values()):
        engine.step()
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_tok_s": tokens / decode_s, "weight_bytes": model_weight_bytes(engine.model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small qwen3_moe demo, generated once)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tp_bench.json"))
    ap.add_argument("--threads", type=int, default=2, help="threads of TP 1; each TP 2 rank gets half")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    a = ap.parse_args()
    model = a.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    args = {"prefill_len": a.prefill_len, "decode_batch": a.decode_batch, "decode_tokens": a.decode_tokens}

    weights = {"tp1": model_weight_bytes(load_model(model))}
    for rank in range(2):
        shard = load_model(model, group=RankGroup(rank, 2, None), layout=ParallelLayout(tp=2))
        weights[f"tp2_rank{rank}"] = model_weight_bytes(shard)

    # tp1_half: TP 1 on one rank's threads, the control that separates splitting the model from running fewer
    # threads per process (on a busy host, OpenMP threads waiting for each other cost much)
    runs: dict[str, list[dict]] = {"tp1": [], "tp1_half": [], "tp2": []}
    half = max(a.threads // 2, 1)
    for _ in range(a.repeats):
        runs["tp1"].append(measure(None, model, a.threads, args))
        runs["tp1_half"].append(measure(None, model, half, args))
        ranks = run_on_ranks(2, measure, (model, half, args), timeout_s=600)
        runs["tp2"].append(
            {"prefill_s": max(r["prefill_s"] for r in ranks), "decode_tok_s": min(r["decode_tok_s"] for r in ranks)}
        )
    summary = {
        name: {
            "prefill_s": statistics.median(r["prefill_s"] for r in rs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "model": model,
        "threads": {"tp1": a.threads, "tp1_half": half, "tp2_per_rank": half},
        **args,
        "weight_bytes": weights,
        "summary": summary,
        "runs": runs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({"cpu": cpu, "weight_bytes": weights, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
