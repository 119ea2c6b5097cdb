"""Parallelism inside one worker group, on CPU (gloo) or GPU (NCCL: same code path). One function per
measurement; the EP ones share one spawned group (rank 1 runs the same steps as rank 0, SPMD).

    .venv/bin/python benchmarks/parallel_bench.py [--model DIR] [--out JSON] [--quick]

- ep_step: the MoE part of a step (every sparse layer's block: router, routed experts, shared expert) on
  a (T, D) batch, T = PREFILL_T (prefill-like) and DECODE_T (decode-like), median over repeats: EP = 1 with
  2 threads against EP = 2 x 1 thread with the all-to-all dispatch and with the all-reduce combine. The
  EP = 1 run comes first, before rank 1 exists (a rank waiting in a gloo collective polls a core); the two
  EP = 2 modes run in one group, one after the other.
- ep_imbalance: a skewed router (a few experts favoured, different ones per workload) at EP = 2: the
  busiest rank over the mean rank (shared/model/expert_parallel.py RankLoad, what the worker exports as
  pdserve:moe_rank_imbalance) with the default contiguous placement, then with a placement planned from the
  same workload's expert load with REDUNDANT replicas (shared/sharding/placement.py), for a prefill-like
  (long prompts: 512-token batches) and a decode-like (many 16-token steps) workload.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.host_info import cpu_info, describe, load_average  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.model.expert_shards import take_rank_load  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.parallel.launch import local_rendezvous, spawn_followers  # noqa: E402
from shared.sharding.dispatch import EPDispatch  # noqa: E402
from shared.sharding.group import RankGroup  # noqa: E402
from shared.sharding.layout import ParallelLayout  # noqa: E402
from shared.sharding.placement import plan_placement  # noqa: E402

EP = 2
PREFILL_T, DECODE_T = 512, 16
REDUNDANT = 2
# workload → (tokens per forward, forwards, the experts its router favours and by how much (logit bias))
WORKLOADS = {"prefill": (512, 4, {0: 2.5, 1: 2.0, 2: 1.5}), "decode": (16, 128, {5: 2.5, 6: 2.0, 7: 1.5})}


def _moe_stack(model):
    return list(model.sparse_layers().values())


def _run_moe(moes, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for moe in moes:
            x = x + moe(x)
    return x


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ep1_step(model_dir: str, repeats: int) -> dict:
    """EP = 1, one process with both cores: median seconds of the MoE stack per T. Run while no other rank
    exists (a rank waiting in a gloo collective polls, taking a core from the measurement)."""
    torch.set_num_threads(2)
    single = _moe_stack(load_model(model_dir))
    out = {}
    for t in (PREFILL_T, DECODE_T):
        x = torch.randn(t, single[0].gate.in_features, generator=torch.Generator().manual_seed(t))
        out[f"T={t} ep=1 x 2 threads"] = _time(lambda x=x: _run_moe(single, x), repeats)
    return out


def ep2_step(group: RankGroup, model_dir: str, repeats: int) -> dict:
    """EP = 2 x 1 thread, each combine: median seconds of the MoE stack per T (rank 0's clock: it waits
    for rank 1 in the collectives)."""
    torch.set_num_threads(1)
    out = {}
    for mode in EPDispatch:
        moes = _moe_stack(load_model(model_dir, group=group, layout=ParallelLayout(ep=EP), ep_dispatch=mode))
        for t in (PREFILL_T, DECODE_T):
            x = torch.randn(t, moes[0].gate.in_features, generator=torch.Generator().manual_seed(t))
            group.barrier()
            out[f"T={t} ep=2 x 1 thread {mode}"] = _time(lambda m=moes, x=x: _run_moe(m, x), repeats)
    return out


def _skew_router(moes, favoured: dict[int, float], direction: torch.Tensor) -> None:
    """Hidden states carry `direction` (a shared mean, as real ones do); gate rows of the favoured experts
    gain bias / |direction|^2 along it, so their logits rise by about `bias` for every token."""
    with torch.no_grad():
        for moe in moes:
            for e, bias in favoured.items():
                moe.gate.weight[e] += bias * direction / direction.dot(direction)


def _workload(moes, tokens: int, forwards: int, direction: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(forwards):
            x = torch.randn(tokens, direction.shape[0], generator=g) + direction
            for moe in moes:
                moe(x)


def ep_imbalance(group: RankGroup, model_dir: str) -> dict:
    torch.set_num_threads(1)
    hidden = load_model(model_dir).config.hidden_size
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, (tokens, forwards, favoured) in WORKLOADS.items():
        row = {}
        placement = None
        for label in ("default placement", f"planned, {REDUNDANT} redundant"):
            model = load_model(model_dir, group=group, layout=ParallelLayout(ep=EP), expert_placement=placement)
            moes = _moe_stack(model)
            _skew_router(moes, favoured, direction)
            model.take_expert_load()
            take_rank_load(model)
            _workload(moes, tokens, forwards, direction, seed=2)
            load = take_rank_load(model)
            stats = {layer: c.tolist() for layer, c in model.take_expert_load().items()}
            assert load is not None
            row[label] = {"imbalance": round(load.imbalance, 4), "per_rank_pairs": load.per_rank}
            placement = plan_placement(stats, EP, REDUNDANT, model.config.num_experts)
        out[name] = row
    return out


def _all(group: RankGroup, model_dir: str, repeats: int) -> dict:
    return {"ep2_step": ep2_step(group, model_dir, repeats), "ep_imbalance": ep_imbalance(group, model_dir)}


def _follower(group: RankGroup, model_dir: str, repeats: int) -> None:
    _all(group, model_dir, repeats)


def run_ep(model_dir: str, repeats: int) -> dict:
    single = ep1_step(model_dir, repeats)
    rdv = local_rendezvous(EP, timeout_s=600)
    procs = spawn_followers(rdv, _follower, (model_dir, repeats))
    result = _all(RankGroup.join(rdv, 0), model_dir, repeats)
    for p in procs:
        p.join(60)
    return {"ep_step": {**single, **result.pop("ep2_step")}, **result}


def print_tables(result: dict) -> None:
    print("\nMoE stack per step (median seconds)")
    for name, s in result["ep_step"].items():
        print(f"  {name:<40} {s * 1000:9.2f} ms")
    print(f"\nbusiest EP rank / mean rank (skewed router, ep={EP})")
    for workload, row in result["ep_imbalance"].items():
        for label, v in row.items():
            print(f"  {workload:<8} {label:<24} {v['imbalance']:.3f}  pairs per rank {v['per_rank_pairs']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo small qwen3_moe)")
    parser.add_argument("--out", default="parallel_bench.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    model_dir = args.model or str(ensure_demo_checkpoint("/tmp/pdserve-demo-small-qwen3_moe", size="small"))
    info = cpu_info()
    print(describe(info))
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": info,
        "load_average_before": load_average(),
        "model": model_dir,
        **run_ep(model_dir, repeats=3 if args.quick else 10),
        "load_average_after": load_average(),
    }
    print_tables(result)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
