"""`pdserve experts plan`: an expert placement from expert-load statistics (shared/sharding/placement.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.sharding.placement import imbalance, parse_stats, plan_placement, rank_loads


def add_experts_command(sub) -> None:
    experts = sub.add_parser("experts", help="expert placement for expert-parallel worker groups")
    actions = experts.add_subparsers(dest="experts_command", required=True)
    plan = actions.add_parser(
        "plan", help="plan which experts (and redundant replicas of hot ones) each EP rank holds, per layer"
    )
    plan.add_argument(
        "--stats", required=True, help="JSON {layer: [tokens per expert]} or a worker's /metrics scrape (text)"
    )
    plan.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    plan.add_argument("--redundant", type=int, default=0, help="extra slots per layer for replicas of hot experts")
    plan.add_argument("--num-experts", type=int, default=None, help="experts per layer (default: from the stats)")
    plan.add_argument("--out", required=True, help="placement JSON to write (--expert-placement of a worker)")
    plan.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    stats = parse_stats(Path(args.stats).read_text())
    placement = plan_placement(stats, args.ep, args.redundant, args.num_experts)
    Path(args.out).write_text(json.dumps(placement.to_json(), indent=1) + "\n")
    # the same packing without replicas, for comparison (when the experts alone split evenly over the ranks)
    before = plan_placement(stats, args.ep, 0, placement.num_experts) if placement.num_experts % args.ep == 0 else None
    for layer in sorted(stats):
        now = imbalance(rank_loads(placement, stats)[layer])
        was = f"{imbalance(rank_loads(before, stats)[layer]):.3f} without replicas -> " if before else ""
        print(f"layer {layer}: busiest rank / mean rank load {was}{now:.3f}")
    print(f"wrote {args.out} (ep={placement.ep}, {placement.slots_per_rank} slots per rank)")
    return 0
