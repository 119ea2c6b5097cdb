"""Hot experts that move, through real expert-parallel worker groups on this CPU: static placement against live
per-phase re-placement (`--eplb`), for a prefill-heavy and a decode-heavy workload, at EP 2 and EP 4.

    PYTHONPATH=. python benchmarks/eplb_shift.py [--ep 2 4] [--quick] [--out eplb_shift.json]

The model: the `small` qwen3_moe demo (8 sparse layers, 8 experts, top-2, random weights) made to route by
topic. The vocabulary is cut into TOPICS groups of tokens; each group's embeddings gain a direction of their
own, and in every sparse layer the router's rows of the topic's hot experts gain the same direction, so a
token of that topic (and, through attention, the tokens decoded after a prompt of it) raises those experts'
logits by about the topic's bias. A workload walks through the topics one after another (a traffic phase each:
different hot experts, different skew), so the hot experts shift over time; the same checkpoint is served by
every rank (the router is replicated: every rank routes alike).

Workloads, each on a group of its own (per phase, as a disaggregated deployment runs them):
- prefill: long prompts, one output token (every step a prefill step);
- decode: short prompts, long outputs (the steps after the first few are decode steps).

Placements: `static` (the group without --eplb: the contiguous default) and `live` (--eplb with a short window
and interval, `--eplb-redundant` one slot per rank). Per step: wall time and the dispatch's own counters
(shared/model/expert_shards.py take_rank_load: pairs per rank, Σ over layers of the busiest rank's), so the
imbalance is the measured one the worker exports (pdserve:moe_rank_imbalance), not a prediction. Figures:
busiest / mean over the whole workload (weighted by pairs) and per tenth of it; decode throughput = decode
tokens over the time of the decode-only steps (a rebalance's staging and swap happen inside steps, so their
pauses count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.host_info import cpu_info, describe, load_average  # noqa: E402
from services.demo_model import write_demo_checkpoint  # noqa: E402
from shared.engine.config import EngineConfig, EplbConfig, SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.expert_shards import take_rank_load  # noqa: E402
from shared.parallel.group_engine import start_group  # noqa: E402
from shared.worker.expert_recorder import ExpertTraceRecorder  # noqa: E402

# topic → (its hot experts, the router bias they get): the phases of a workload, in order. The default
# contiguous split at EP 2 is {0..3} | {4..7}, at EP 4 {0,1} | {2,3} | {4,5} | {6,7}: each topic's hot set
# sits on few ranks of it
TOPICS = [((0, 1), 10.0), ((5, 6, 7), 8.0), ((2, 3), 6.0)]
FIRST_TOKEN = 3  # below: the byte tokens used by nobody in particular
TOKENS_PER_TOPIC = 80
EMBED_SCALE = 3.0  # the topic direction's weight in its tokens' embeddings, relative to their own norm


def topic_tokens(topic: int) -> range:
    start = FIRST_TOKEN + topic * TOKENS_PER_TOPIC
    return range(start, start + TOKENS_PER_TOPIC)


def write_skewed_checkpoint(out: Path, seed: int = 0) -> Path:
    """The small qwen3_moe demo with topic routing (module docstring)."""
    from safetensors.torch import load_file, save_file

    if (out / "skewed.json").is_file():
        return out
    write_demo_checkpoint(out, arch="qwen3_moe", size="small", seed=seed)
    (path,) = sorted(out.glob("*.safetensors"))
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    directions = torch.linalg.qr(torch.randn(embed.shape[1], len(TOPICS), generator=g))[0].T  # orthonormal
    norm = embed.norm(dim=1).mean()
    for topic, direction in enumerate(directions):
        rows = list(topic_tokens(topic))
        embed[rows] += EMBED_SCALE * norm * direction
    for name, gate in tensors.items():
        if not name.endswith(".mlp.gate.weight"):
            continue
        for (hot, bias), direction in zip(TOPICS, directions, strict=True):
            for e in hot:  # after the RMSNorm a topic token is ~sqrt(D) along its direction: +bias on the logit
                gate[e] += bias / embed.shape[1] ** 0.5 * direction
    save_file(tensors, path, metadata={"format": "pt"})
    (out / "skewed.json").write_text(json.dumps({"topics": TOPICS, "embed_scale": EMBED_SCALE}) + "\n")
    return out


# --eplb's settings for the live runs: a window shorter than a traffic phase (20 prefill steps, 64 decode steps),
# a plan at most every 2 s, a move only for a 10 % predicted gain (a move pauses the group: every changed layer's
# slots cross the collective and the CPU kernels repack them)
LIVE = EplbConfig(enabled=True, window_steps=16, interval_s=2.0, min_gain=0.10)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    max_tokens: int
    requests: int  # per topic, all submitted at the topic's start
    max_batched_tokens: int


WORKLOADS = {
    "prefill": Workload("prefill", prompt_tokens=192, max_tokens=1, requests=40, max_batched_tokens=384),
    "decode": Workload("decode", prompt_tokens=12, max_tokens=64, requests=32, max_batched_tokens=384),
}


def prompts(topic: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(list(topic_tokens(topic)))
    return [tokens[torch.randint(len(tokens), (length,), generator=g)].tolist() for _ in range(n)]


def engine_config(
    model: Path, ep: int, live: bool, workload: Workload, redundant: int | None = None, settings: EplbConfig = LIVE
) -> EngineConfig:
    eplb = dataclasses.replace(settings, redundant=ep if redundant is None else redundant) if live else EplbConfig()
    blocks = -(-(workload.prompt_tokens + workload.max_tokens) // 16)  # a request's, at block_size 16
    return EngineConfig(
        model=str(model),
        ep=ep,
        threads=1,
        block_size=16,
        num_kv_blocks=max(512, workload.requests * blocks + 64),
        max_model_len=512,
        scheduler=SchedulerConfig(max_num_seqs=workload.requests, max_num_batched_tokens=workload.max_batched_tokens),
        eplb=eplb,
    )


def run(
    engine: Engine,
    workload: Workload,
    topics: int,
    seed: int,
    observe: Callable[[Engine], None] | None = None,
    moves: Callable[[], int] = lambda: 0,
) -> list[dict]:
    """Every topic's requests in turn, step by step → per step: topic, seconds, prefill and decode tokens,
    pairs per rank, Σ of the busiest rank's pairs, whether a weight move ran in it (`moves()`: the group's count
    of stage and swap ops). `observe(engine)` after each step (a trace recorder)."""
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    take_rank_load(engine.model)  # what loading routed is no traffic
    steps = []
    for topic in range(topics):
        for i, p in enumerate(prompts(topic, workload.requests, workload.prompt_tokens, seed + topic)):
            engine.add_request(f"{workload.name}-{topic}-{i}", p, params)
        while engine.has_unfinished():
            prefill, decode, moved = engine.stats.prefill_tokens, engine.stats.decode_tokens, moves()
            began = time.perf_counter()
            engine.step()
            took = time.perf_counter() - began
            if observe is not None:
                observe(engine)
            load = take_rank_load(engine.model)
            assert load is not None
            steps.append(
                {
                    "topic": topic,
                    "s": took,
                    "prefill_tokens": engine.stats.prefill_tokens - prefill,
                    "decode_tokens": engine.stats.decode_tokens - decode,
                    "per_rank": load.per_rank,
                    "peak": load.peak,
                    "moved": moves() != moved,
                }
            )
    return steps


def summarise(steps: list[dict], ep: int) -> dict:
    def ratio(part: list[dict]) -> float:
        total = sum(sum(s["per_rank"]) for s in part)
        return round(sum(s["peak"] for s in part) * ep / total, 4) if total else 1.0

    tenth = max(1, len(steps) // 10)
    decode_steps = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    decode_s = sum(s["s"] for s in decode_steps)
    prefill_s = sum(s["s"] for s in steps if s["prefill_tokens"] > 0)
    still = [s for s in steps if not s["moved"]]  # the steps no weight move ran in: what balance alone gives
    still_decode = [s for s in still if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    still_decode_s = sum(s["s"] for s in still_decode)
    still_prefill_s = sum(s["s"] for s in still if s["prefill_tokens"] > 0)
    return {
        "steps": len(steps),
        "imbalance": ratio(steps),
        "imbalance_per_topic": [
            ratio([s for s in steps if s["topic"] == t]) for t in sorted({s["topic"] for s in steps})
        ],
        "imbalance_over_time": [ratio(steps[i : i + tenth]) for i in range(0, len(steps), tenth)],
        "seconds": round(sum(s["s"] for s in steps), 3),
        "decode_tokens_per_s": round(sum(s["decode_tokens"] for s in decode_steps) / decode_s, 2) if decode_s else None,
        "prefill_tokens_per_s": round(sum(s["prefill_tokens"] for s in steps) / prefill_s, 2) if prefill_s else None,
        "steps_with_a_move": len(steps) - len(still),
        "decode_tokens_per_s_without_moves": (
            round(sum(s["decode_tokens"] for s in still_decode) / still_decode_s, 2) if still_decode_s else None
        ),
        "prefill_tokens_per_s_without_moves": (
            round(sum(s["prefill_tokens"] for s in still) / still_prefill_s, 2) if still_prefill_s else None
        ),
    }


def measure(
    model: Path,
    ep: int,
    live: bool,
    workload: Workload,
    topics: int,
    seed: int,
    redundant: int | None = None,
    trace: Path | None = None,
    settings: EplbConfig = LIVE,
) -> dict:
    """One group, one workload → the summary (and with `trace`, the workload's expert routing recorded there, as
    --record-expert-trace would: the role is the workload's name)."""
    config = engine_config(model, ep, live, workload, redundant, settings)
    deaths: list = []
    group = start_group(config, on_death=lambda rank, status: deaths.append((rank, status)))
    try:
        # warm-up (first-step costs: kernel set-up, packing): two requests of the first topic, the start of its
        # phase as far as the live window is concerned
        run(group.engine, dataclasses.replace(workload, requests=2, max_tokens=min(workload.max_tokens, 2)), 1, 99)
        recorder = None
        if trace is not None:
            recorder = ExpertTraceRecorder(trace, group.engine, workload.name, "eplb-shift", f"ep{ep}")
            recorder.observe(group.engine)
        counts = group.ops.state.counts
        steps = run(
            group.engine,
            workload,
            topics,
            seed,
            None if recorder is None else recorder.observe,
            lambda: counts["eplb_stage"] + counts["eplb_swap"],
        )
        if recorder is not None:
            recorder.close()
        out = summarise(steps, ep)
        if group.rebalancer is not None:
            stats = group.rebalancer.take_stats()
            out |= {
                "rebalances": stats.rebalances,
                "bytes_moved": stats.bytes_moved,
                "pause_s": round(sum(stats.pauses_s), 3),
                "placements": [p.target.to_json()["layers"]["1"] for p in group.rebalancer.history][:6],
            }
        out["per_step"] = steps
    finally:
        group.close()
    if deaths:
        raise RuntimeError(f"a follower died: {deaths}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--model", default="/tmp/pdserve-eplb-shift-small", help="where the skewed checkpoint goes")
    parser.add_argument("--quick", action="store_true", help="fewer requests per topic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live-redundant", type=int, default=None, help="--eplb-redundant (default: one per rank)")
    parser.add_argument("--traces", default=None, help="record the static runs' routing traces in this directory")
    parser.add_argument("--prefill-requests", type=int, default=WORKLOADS["prefill"].requests, help="per topic")
    parser.add_argument("--decode-requests", type=int, default=WORKLOADS["decode"].requests,
                        help="per topic, all decoding together: the decode batch")  # fmt: skip
    parser.add_argument("--window-steps", type=int, default=LIVE.window_steps, help="--eplb-window-steps")
    parser.add_argument("--interval-s", type=float, default=LIVE.interval_s, help="--eplb-interval-s")
    parser.add_argument("--min-gain", type=float, default=LIVE.min_gain, help="--eplb-min-gain")
    parser.add_argument("--stage-layers", type=int, default=LIVE.stage_layers, help="--eplb-stage-layers")
    parser.add_argument("--out", default="eplb_shift.json")
    args = parser.parse_args()
    model = write_skewed_checkpoint(Path(args.model))
    settings = dataclasses.replace(LIVE, window_steps=args.window_steps, interval_s=args.interval_s,
                                   min_gain=args.min_gain, stage_layers=args.stage_layers)  # fmt: skip
    workloads = {
        "prefill": dataclasses.replace(WORKLOADS["prefill"], requests=args.prefill_requests),
        "decode": dataclasses.replace(WORKLOADS["decode"], requests=args.decode_requests),
    }
    info = cpu_info()
    print(describe(info), flush=True)
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": info,
        "load_average_before": load_average(),
        "topics": TOPICS,
        "live": dataclasses.asdict(settings),
        "workloads": {name: dataclasses.asdict(w) for name, w in workloads.items()},
        "quick": args.quick,
        "live_redundant": args.live_redundant,
        "runs": [],
    }
    for ep in args.ep:
        for name in args.workloads:
            workload = workloads[name]
            if args.quick:
                workload = dataclasses.replace(workload, requests=max(2, workload.requests // 2))
            row = {"ep": ep, "workload": name}
            for label, live in (("static", False), ("live", True)):
                began = time.monotonic()
                trace = None
                if args.traces and not live:
                    trace = Path(args.traces) / f"{name}-ep{ep}.jsonl"
                    trace.unlink(missing_ok=True)
                row[label] = measure(model, ep, live, workload, len(TOPICS), args.seed, args.live_redundant, trace,
                                     settings)  # fmt: skip
                s = row[label]
                extra = f", {s['rebalances']} rebalances, {s['pause_s']} s paused" if live else ""
                print(
                    f"ep={ep} {name:<7} {label:<6} busiest/mean {s['imbalance']:.3f} per topic "
                    f"{s['imbalance_per_topic']} decode tok/s {s['decode_tokens_per_s']} prefill tok/s "
                    f"{s['prefill_tokens_per_s']} ({time.monotonic() - began:.0f} s{extra})",
                    flush=True,
                )
            result["runs"].append(row)
    result["load_average_after"] = load_average()
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


def print_table(result: dict) -> None:
    """Throughput: the workload's own (prefill tokens/s of the prefill one, decode tokens/s of the decode one)."""
    print(
        "\n| EP | workload | static busiest/mean | live busiest/mean | static tok/s | live tok/s | live / static "
        "| live tok/s, steps without a move | live / static |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in result["runs"]:
        key = f"{row['workload']}_tokens_per_s"
        still = f"{key}_without_moves"
        s, v = row["static"], row["live"]
        print(
            f"| {row['ep']} | {row['workload']} | {s['imbalance']:.3f} | {v['imbalance']:.3f} | {s[key]} | {v[key]} "
            f"| {v[key] / s[key]:.2f} | {v[still]} | {v[still] / s[key]:.2f} |"
        )


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
