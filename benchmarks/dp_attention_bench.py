"""Data-parallel attention + expert-parallel MoE decode (--dp-attention) against tensor-parallel decode of the same
ranks, at equal batch: decode throughput and TPOT.

    .venv/bin/python benchmarks/dp_attention_bench.py [--model DIR] [--out JSON] [--ranks R] [--threads T]
        [--batches B,B,...] [--prompt-len N] [--decode-tokens N] [--repeats N]

For each batch size B, on R local ranks (gloo, this process rank 0: `run_on_ranks`, SPMD: every rank builds its
engine and runs the same requests, as tests/integration/test_dp_attention_ranks.py), each layout runs B prompts of
--prompt-len tokens, then --decode-tokens greedy tokens each; only the steps after every request has its first
token are timed:

- dp: --ep R --dp-attention: each rank attention over its own B/R requests, experts partitioned, tokens
  exchanged all-to-all in each MoE layer;
- tp: --tp R: attention heads, dense MLPs and each expert's intermediate split over the R ranks, all-reduced;
- tp_ep: --tp R --ep R: attention split, experts partitioned (all-reduce combine).

Reported per layout and batch: decode tokens/s (B x steps / seconds, the slowest rank's) and TPOT (ms per decode
step: every running request gets one token a step). Default model: the small DeepSeek-V3 demo (MLA, 8 experts,
a dense first layer), generated once. Repeats alternate the layouts so drift on a shared host hits all; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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
from shared.parallel.launch import run_on_ranks  # noqa: E402
from shared.sharding.group import RankGroup  # noqa: E402

LAYOUTS = {
    "dp": lambda r: dict(ep=r, dp_attention=True),
    "tp": lambda r: dict(tp=r),
    "tp_ep": lambda r: dict(tp=r, ep=r),
}


def measure(group: RankGroup, model: str, layout: str, threads: int, batch: int, args: dict) -> dict:
    """This rank's engine under `layout`: B requests to their first token, then the timed decode steps."""
    config = EngineConfig(
        model=model,
        threads=threads,
        max_model_len=args["prompt_len"] + args["decode_tokens"] + 8,
        kv_cache_bytes=128 << 20,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, args["prompt_len"])),
        **LAYOUTS[layout](group.world),
    )
    engine = Engine.build(config, group=group)
    vocab = engine.model.config.vocab_size
    engine.generate([[5 + i % (vocab - 10) for i in range(16)]], SamplingParams(max_tokens=2, temperature=0.0))
    params = SamplingParams(max_tokens=args["decode_tokens"] + 1, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{b}", [(b * 13 + i) % (vocab - 10) + 3 for i in range(args["prompt_len"])], params)
    while not all(r.output_token_ids for r in engine.requests.values()):
        engine.step()
    tokens, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return {"decode_s": time.perf_counter() - start, "tokens": tokens, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small deepseek_v3 demo, generated once)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dp_attention_bench.json"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--batches", default="2,8,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    a = ap.parse_args()
    model = a.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-small-deepseek_v3", "deepseek_v3", "small"))
    args = {"prompt_len": a.prompt_len, "decode_tokens": a.decode_tokens}
    layouts = a.layouts.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    load_before = _uptime()
    runs: dict[str, dict[int, list[dict]]] = {name: {b: [] for b in batches} for name in layouts}
    for _ in range(a.repeats):
        for batch in batches:
            for name in layouts:
                ranks = run_on_ranks(a.ranks, measure, (model, name, a.threads, batch, args), timeout_s=600)
                slowest = max(r["decode_s"] for r in ranks)
                runs[name][batch].append(
                    {"decode_s": slowest, "tokens": ranks[0]["tokens"], "steps": ranks[0]["steps"]}
                )
    summary = {
        name: {
            batch: {
                "decode_tok_s": round(statistics.median(r["tokens"] / r["decode_s"] for r in rs), 1),
                "tpot_ms": round(statistics.median(1e3 * r["decode_s"] / r["steps"] for r in rs), 2),
            }
            for batch, rs in by_batch.items()
        }
        for name, by_batch in runs.items()
    }
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "load_before": load_before,
        "load_after": _uptime(),
        "model": model,
        "ranks": a.ranks,
        "threads_per_rank": a.threads,
        **args,
        "summary": summary,
        "runs": runs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("cpu", "load_before", "load_after", "summary")}, indent=2))


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
