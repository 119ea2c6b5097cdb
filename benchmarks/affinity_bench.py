"""Does decode routed by expert affinity pay? The expert load each decode worker sees, with the routing on and off,
in one process: one prefill engine and two decode engines over the same tiny MoE model, the hand-off through
export_kv / import_kv, the routing through the code the workers run (shared/expert_affinity.py: the request's
summary, each decode worker's decayed window folded once per simulated heartbeat, `choose`).

    .venv/bin/python benchmarks/affinity_bench.py [--requests N] [--out JSON]

The skewed router: requests come from TOPICS; a topic's prompt tokens come from its own slice of the vocabulary,
whose embeddings carry a direction of the topic's own, and the gate rows of the topic's favoured experts rise along
it (every sparse layer), so a topic's tokens prefer its experts (a synthetic skew, as benchmarks/parallel_bench.py
makes one). Requests arrive a few per tick, topics interleaved at random; each tick every decode engine steps once.

Routing off: the decode worker with the fewest running requests (the shared queue's effect); on: `choose` among the
two by overlap, the same fallback when nothing overlaps. Reported per decode worker over the run: the busiest
expert's tokens over the mean expert's (per sparse layer, averaged), the share of its tokens its hottest 25% of
experts take, and how many of its requests came from its main topic; and whether every request's tokens were the
same with the routing on and off (they must be).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.host_info import cpu_info, describe  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared import expert_affinity  # noqa: E402
from shared.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.messages import AffinityCandidate  # noqa: E402
from shared.model.loader import load_model  # noqa: E402

# topic → the experts its router favours (logit bias); the tiny model has 8 experts, top-2
TOPICS = {"a": {0: 3.0, 1: 2.5}, "b": {4: 3.0, 5: 2.5}, "c": {2: 3.0, 7: 2.5}}
VOCAB_SLICE = 60  # each topic's prompt tokens: its own 60 ids
ARRIVALS_PER_TICK = 1
BEAT_TICKS = 4  # a simulated heartbeat: each decode worker's load folded into its window
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _skew(model, seed: int = 0) -> dict[str, range]:
    """Give each topic a vocabulary slice whose embeddings carry a direction, and its experts' gate rows a bias
    along it; → topic → its token ids."""
    g = torch.Generator().manual_seed(seed)
    embed = model.model.embed_tokens.weight
    slices = {}
    with torch.no_grad():
        for i, (topic, favoured) in enumerate(TOPICS.items()):
            ids = range(10 + i * VOCAB_SLICE, 10 + (i + 1) * VOCAB_SLICE)
            direction = torch.randn(embed.shape[1], generator=g) * embed.norm(dim=1).mean() / embed.shape[1] ** 0.5
            embed[ids.start : ids.stop] += direction
            for moe in model.sparse_layers().values():
                for e, bias in favoured.items():
                    moe.gate.weight[e] += bias * direction / direction.dot(direction)
            slices[topic] = ids
    return slices


def _requests(slices: dict[str, range], n: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(sorted(slices))
        ids = slices[topic]
        out.append((topic, [rng.randrange(ids.start, ids.stop) for _ in range(rng.randrange(24, 64))]))
    return out


def _engine(model_dir: str, model) -> Engine:
    config = EngineConfig(
        model=model_dir,
        block_size=16,
        num_kv_blocks=512,
        max_model_len=256,
        threads=1,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
    )
    return Engine.build(config, model=model)


def _skewed_model(model_dir: str):
    """The checkpoint with the topics' skew (the same on every load: seeded); one per engine, so that each engine's
    expert counters are its own."""
    model = load_model(model_dir)
    return model, _skew(model)


def run(model_dir: str, requests: list[tuple[str, list[int]]], on: bool) -> dict:
    prefill = _engine(model_dir, _skewed_model(model_dir)[0])
    decode = [_engine(model_dir, _skewed_model(model_dir)[0]) for _ in range(2)]
    windows = [expert_affinity.HotExpertsWindow(), expert_affinity.HotExpertsWindow()]
    load = [torch.zeros(0) for _ in decode]
    topics_of = [dict.fromkeys(TOPICS, 0), dict.fromkeys(TOPICS, 0)]
    tokens: dict[str, list[int]] = {}
    matched = 0
    for d in decode:
        d.model.take_expert_load()
    pending = list(enumerate(requests))
    tick = 0
    while pending or any(d.has_unfinished() for d in decode):
        for _ in range(ARRIVALS_PER_TICK):
            if not pending:
                break
            i, (topic, prompt) = pending.pop(0)
            rid = f"r{i}"
            prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
            prefill.trace_experts(rid)
            first = []
            while prefill.has_unfinished():
                for o in prefill.step():
                    first += o.new_token_ids
            hot = expert_affinity.summarise(prefill.take_request_experts(rid), expert_affinity.REQUEST_TOP_K)
            kv = prefill.export_kv(rid)
            prefill.release_kv(rid)
            by_load = min(range(2), key=lambda k: (decode[k].num_running + decode[k].num_waiting, k))
            chosen = by_load
            if on:
                candidates = [
                    AffinityCandidate(str(k), decode[k].num_running, w.hot)
                    for k, w in enumerate(windows)
                    if w.hot is not None
                ]
                pick = expert_affinity.choose(hot, candidates) if len(candidates) == 2 else None
                if pick is not None:
                    chosen, matched = int(pick), matched + 1
            decode[chosen].import_kv(rid, prompt, first, PARAMS, kv)
            tokens[rid] = list(first)
            topics_of[chosen][topic] += 1
        for d in decode:
            for o in d.step():
                tokens[o.request_id] += o.new_token_ids
        tick += 1
        if tick % BEAT_TICKS == 0 or not (pending or any(d.has_unfinished() for d in decode)):
            for k, d in enumerate(decode):
                beat = {layer: c.tolist() for layer, c in d.model.take_expert_load().items()}
                windows[k].add(beat)
                counts = torch.tensor([beat[layer] for layer in sorted(beat)], dtype=torch.float64)
                load[k] = counts if load[k].numel() == 0 else load[k] + counts
    workers = []
    for k in range(2):
        per_layer = load[k]  # (sparse layers, E) decode tokens routed over the run
        busiest = (per_layer.max(1).values / per_layer.mean(1)).mean().item()
        quarter = max(1, per_layer.shape[1] // 4)
        hottest = (per_layer.sort(1, descending=True).values[:, :quarter].sum(1) / per_layer.sum(1)).mean().item()
        served = topics_of[k]
        workers.append({
            "requests": sum(served.values()),
            "by_topic": served,
            "main_topic_share": round(max(served.values()) / max(1, sum(served.values())), 3),
            "busiest_over_mean_expert": round(busiest, 3),
            "hottest_quarter_share": round(hottest, 3),
        })  # fmt: skip
    return {"matched": matched, "workers": workers, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo tiny qwen3_moe)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="affinity_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model or str(ensure_demo_checkpoint("/tmp/pdserve-demo-tiny-qwen3_moe", size="tiny"))
    info = cpu_info()
    print(describe(info))
    _, slices = _skewed_model(model_dir)
    requests = _requests(slices, args.requests, args.seed)
    runs = {label: run(model_dir, requests, on) for label, on in (("off", False), ("on", True))}
    same = runs["off"].pop("tokens") == runs["on"].pop("tokens")
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": info,
        "model": model_dir,
        "requests": args.requests,
        "topics": {t: sorted(f) for t, f in TOPICS.items()},
        "tokens_identical_on_and_off": same,
        **runs,
    }
    print(f"\n{args.requests} requests, {len(TOPICS)} topics, 2 decode workers; tokens identical on/off: {same}")
    for label, r in runs.items():
        print(f"affinity {label} (routed by affinity: {r['matched']})")
        for k, w in enumerate(r["workers"]):
            busiest, hottest = w["busiest_over_mean_expert"], w["hottest_quarter_share"]
            print(f"  decode {k}: {w['requests']:3d} requests {w['by_topic']}  busiest/mean expert {busiest:.3f}  "
                  f"hottest 25% of experts {hottest:.3f}")  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    if not same:
        raise SystemExit("tokens differ between affinity on and off")


if __name__ == "__main__":
    main()
