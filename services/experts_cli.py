"""`pdserve experts plan`: an expert placement from expert-load statistics (shared/sharding/placement.py);
`pdserve experts show`: a role's expert and rank load over time as a heatmap (services/experts_show.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.sharding.placement import ExpertPlacement, imbalance, parse_stats, plan_placement, rank_loads
from shared.sharding.rebalance import initial_placement


def add_experts_command(sub) -> None:
    experts = sub.add_parser("experts", help="expert placement for expert-parallel worker groups")
    actions = experts.add_subparsers(dest="experts_command", required=True)
    plan = actions.add_parser(
        "plan", help="plan which experts (and redundant replicas of hot ones) each EP rank holds, per layer"
    )
    plan.add_argument(
        "--stats", required=True, help="JSON {layer: [tokens per expert]} or a worker's /metrics scrape (text)"
    )
    plan.add_argument("--role", default=None, help="a scrape's series of this role only (default: all summed)")
    plan.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    plan.add_argument("--redundant", type=int, default=0, help="extra slots per layer for replicas of hot experts")
    plan.add_argument("--num-experts", type=int, default=None, help="experts per layer (default: from the stats)")
    plan.add_argument("--out", required=True, help="placement JSON to write (--expert-placement of a worker)")
    plan.set_defaults(func=_plan)
    show = actions.add_parser(
        "show", help="draw a role's per-layer expert load and per-rank load over time as a heatmap (PNG)"
    )
    source = show.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="an expert routing trace (a worker's --record-expert-trace file)")
    source.add_argument("--stats", help="a worker's /metrics scrape (text) or JSON {layer: [tokens per expert]}")
    source.add_argument("--url", help="a live worker's metrics URL (http://host:port/metrics), scraped --samples times")
    show.add_argument("--role", default=None, help="prefill | decode | mixed (required for a scrape or URL)")
    show.add_argument("--ep", type=int, default=None, help="draw each rank's load at this EP degree")
    show.add_argument("--redundant", type=int, default=0, help="with --ep: redundant slots, as --eplb-redundant")
    show.add_argument("--placement", default=None, help="draw each rank's load under this placement JSON")
    show.add_argument("--num-experts", type=int, default=None, help="experts per layer (default: from the data)")
    show.add_argument("--columns", type=int, default=120, help="a trace's time bins")
    show.add_argument("--samples", type=int, default=30, help="--url: scrapes (columns + 1)")
    show.add_argument("--interval-s", type=float, default=2.0, help="--url: seconds between scrapes")
    show.add_argument("--out", required=True, help="PNG to write")
    show.set_defaults(func=_show)


def _plan(args: argparse.Namespace) -> int:
    stats = parse_stats(Path(args.stats).read_text(), args.role)
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


def _show(args: argparse.Namespace) -> int:
    from services import experts_show

    if args.trace:
        load = experts_show.from_trace(args.trace, args.role, args.columns)
    else:
        if args.role is None:
            raise SystemExit("--role is needed with --stats or --url: a worker's metrics carry its role's series")
        if args.stats:
            text = Path(args.stats).read_text()
            load = experts_show.from_scrape(text, args.role, args.num_experts, f"scrape {args.stats}")
        else:
            load = experts_show.from_url(args.url, args.role, args.samples, args.interval_s, args.num_experts)
    placement = None
    if args.placement:
        placement = ExpertPlacement.from_file(args.placement)
        placement.check_model(load.num_experts, load.layers, placement.ep)
    elif args.ep:
        placement = initial_placement(load.num_experts, args.ep, load.layers, args.redundant)
    out = experts_show.render(load, placement, args.out)
    totals = load.totals()
    print(f"{load.role}: {len(load.counts)} column(s), {load.source}")
    if placement is not None:
        for layer, loads in rank_loads(placement, totals).items():
            print(f"layer {layer}: busiest rank / mean rank load {imbalance(loads):.3f} (ep={placement.ep})")
    print(f"wrote {out}")
    return 0
