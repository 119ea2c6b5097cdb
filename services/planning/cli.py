"""`pdserve profile` (measure a profile on this host) and `pdserve plan` (size a deployment from one); the model
behind them: docs/planning.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from services.planning.model import PLANE_CPU, PerformanceModel, Plan, Prediction, Slos
from services.planning.profile_file import WorkerConfig, dump_profile, load_profile
from services.planning.workload import Workload, from_bench_result, from_lengths


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _configs(text: str) -> tuple[WorkerConfig, ...]:
    try:
        return tuple(WorkerConfig.parse(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _default_configs() -> str:
    """Single-rank workers of 1, 2, 4, ... cores, up to this process's cores."""
    cores, sizes, n = len(os.sched_getaffinity(0)), [], 1
    while n <= cores:
        sizes.append(str(n))
        n *= 2
    return ",".join(sizes)


def add_planning_commands(sub) -> None:
    prof = sub.add_parser("profile", help="measure prefill and decode costs per worker configuration (a profile file)")
    prof.add_argument("--model", required=True, help="checkpoint directory")
    prof.add_argument("--out", default="profile.json", help="profile file to write (default profile.json)")
    prof.add_argument("--configs", type=_configs, default=None, metavar="LIST",
                      help="worker configurations, CORES[:tpN][:epM] comma-separated, e.g. 1,2,2:tp2 (default: "
                      f"1, 2, 4, ... up to this host's cores: {_default_configs()})")  # fmt: skip
    prof.add_argument("--quick", action="store_true", help="a small grid (seconds on the tiny demo model): tests")
    prof.add_argument("--prompt-lens", type=_ints, help="prefill: prompt lengths (tokens), comma-separated")
    prof.add_argument("--batches", type=_ints, help="decode: batch sizes, comma-separated")
    prof.add_argument("--contexts", type=_ints, help="decode: context lengths (tokens), comma-separated")
    prof.add_argument("--decode-steps", type=int, help="decode: timed steps per (batch, context)")
    prof.add_argument("--repeats", type=int, help="prefill: runs per length (the median counts)")
    prof.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    prof.add_argument("--max-num-seqs", type=int, default=None, help="the workers' (default: the engine's, 64)")
    prof.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="the workers' step token budget (default: the engine's, 512)")  # fmt: skip
    prof.add_argument("--kv-cache-bytes", type=int, default=None, help="the workers' KV pool (default 256 MiB)")
    prof.add_argument("--transfer-ms-per-mb", type=float, default=None,
                      help="KV pull cost per MB (default: the prefill path's cost model's, 0.6)")  # fmt: skip
    prof.add_argument("--pull-overhead-ms", type=float, default=None, help="a KV pull's fixed cost (default 2)")
    prof.add_argument(
        "--plane-ttft-ms",
        type=float,
        default=0.0,
        help="the serving plane's time added to every first token, when known (docs/planning.md)",
    )
    prof.add_argument(
        "--plane-handoff-ms",
        type=float,
        default=0.0,
        help="the serving plane's time added to every hand-off besides the pull (docs/planning.md)",
    )
    prof.add_argument(
        "--plane-step-ms",
        type=float,
        default=0.0,
        help="the workers' own time per step outside the engine (their loop), when known (docs/planning.md)",
    )
    prof.add_argument(
        "--plane-token-ms",
        type=float,
        default=0.0,
        help="the workers' own time per sequence in a step (handing each output over as a token event), when known",
    )
    prof.add_argument("--serving-plane", action="store_true",
                      help="measure the four on a local stack (1 prefill + 1 decode worker of the first config, "
                      "lone requests and batches of 4 and 16) instead of taking them from the flags")  # fmt: skip
    prof.add_argument("--seed", type=int, default=0)
    prof.set_defaults(func=_profile)

    plan = sub.add_parser(
        "plan", help="how many prefill and decode (or mixed) workers a workload needs, from a profile"
    )
    plan.add_argument("--profile", required=True, help="a `pdserve profile` file")
    plan.add_argument("--ttft-ms", type=float, required=True, help="TTFT SLO (ms)")
    plan.add_argument("--tpot-ms", type=float, required=True, help="TPOT SLO (ms)")
    src = plan.add_argument_group("workload (--rate with --isl/--osl, or --workload)")
    src.add_argument("--rate", type=float, help="requests/s (with --workload: instead of the recorded rate)")
    src.add_argument("--isl", type=int, help="input (prompt) length, tokens")
    src.add_argument("--osl", type=int, help="output length, tokens")
    src.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform over [len (1 - r), len (1 + r)], as pdserve bench's random dataset",
    )
    src.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    src.add_argument(
        "--workload",
        metavar="JSON",
        help="a `pdserve bench --result-file` (with --save-detailed: its requests' lengths and rate)",
    )
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--cores", type=int, help="CPU cores to spend (default: the profiled host's)")
    budget.add_argument("--gpus", type=int, help="GPUs to spend (a GPU profile's unit)")
    plan.add_argument("--configs", default=None, metavar="LIST", help="only these profiled configs, e.g. 1,2")
    plan.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="the share of requests that must meet both SLOs for a deployment to be enough (0.9)",
    )
    plan.add_argument(
        "--plane-cpu",
        choices=PLANE_CPU,
        default="shared",
        help="shared (default): the gateway, NATS and Redis run on the budget's cores, as on one host, and slow the "
        "workers by the CPU the profile measured for them; separate: they have cores of their own",
    )
    plan.add_argument("--client-cpu", action="store_true",
                      help="the load's client shares the cores too (a benchmark on the same host)")  # fmt: skip
    plan.add_argument("--requests", type=int, default=None, help="simulated requests (default: ~300 s of arrivals)")
    plan.add_argument("--seed", type=int, default=0, help="the simulated requests' seed")
    plan.add_argument("--top", type=int, default=10, help="alternatives listed (default 10)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_plan)


# ---- profile ----------------------------------------------------------------------------------------------------


def _profile(args: argparse.Namespace) -> int:
    import dataclasses

    from services.planning.profile import FULL, QUICK, ProfileRequest, run_profile
    from shared.engine.config import SchedulerConfig

    grid = QUICK if args.quick else FULL
    given = {"prompt_lens": args.prompt_lens, "batches": args.batches, "contexts": args.contexts,
             "decode_steps": args.decode_steps, "repeats": args.repeats}  # fmt: skip
    grid = dataclasses.replace(grid, **{k: v for k, v in given.items() if v is not None})
    scheduler = SchedulerConfig()
    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    scheduler = dataclasses.replace(scheduler, **{k: v for k, v in limits.items() if v is not None})
    configs = args.configs or _configs(_default_configs())
    transfer = {"transfer_ms_per_mb": args.transfer_ms_per_mb, "pull_overhead_ms": args.pull_overhead_ms}
    req = ProfileRequest(
        model=args.model,
        configs=configs,
        grid=grid,
        dtype=args.dtype,
        scheduler=scheduler,
        kv_cache_bytes=args.kv_cache_bytes,
        plane_ttft_ms=args.plane_ttft_ms,
        plane_handoff_ms=args.plane_handoff_ms,
        plane_step_ms=args.plane_step_ms,
        plane_token_ms=args.plane_token_ms,
        seed=args.seed,
        **{k: v for k, v in transfer.items() if v is not None},
    )
    profile = run_profile(req)
    if args.serving_plane:
        from services.planning.plane import measure_plane

        profile = measure_plane(profile, req)
    Path(args.out).write_bytes(dump_profile(profile))
    print(f"wrote {args.out} ({len(profile.configs)} configs, {profile.host.cpu}, torch {profile.host.torch})")
    return 0


# ---- plan -------------------------------------------------------------------------------------------------------


def _workload(args: argparse.Namespace) -> Workload:
    if args.workload:
        if args.isl or args.osl:
            raise ValueError("give --workload or --isl/--osl, not both")
        return from_bench_result(args.workload, args.rate)
    if args.rate is None or args.isl is None or args.osl is None:
        raise ValueError("the workload: --rate, --isl and --osl (or --workload a bench result)")
    return from_lengths(args.rate, args.isl, args.osl, args.range_ratio, args.burstiness)


def _plan(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.gpus is not None and profile.unit != "gpus":
        raise ValueError(f"{args.profile} is a CPU profile: give --cores")
    if args.cores is not None and profile.unit != "cores":
        raise ValueError(f"{args.profile} is a GPU profile: give --gpus")
    budget = args.cores or args.gpus or profile.host.cores
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    model = PerformanceModel(profile, args.plane_cpu, args.client_cpu)
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else None
    for c in configs or ():
        profile.config(c)  # a ValueError naming the configs it has
    plan = model.plan(_workload(args), Slos(args.ttft_ms / 1e3, args.tpot_ms / 1e3), budget, args.attainment,
                      args.requests, args.seed, configs)  # fmt: skip
    if args.json:
        doc = {"profile": str(args.profile), "model": profile.model.path, "host": profile.host.cpu} | plan.to_json()
        print(json.dumps(doc, indent=1))
    else:
        sys.stdout.write(render(plan, profile, args.profile, args.top))
    return 0


def _ms(seconds: float) -> str:
    return "inf" if seconds == float("inf") else f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def _line(p: Prediction) -> str:
    meet = f"{p.attainment:.0%} of requests meet both SLOs; TTFT {p.ttft_attainment:.0%}, TPOT {p.tpot_attainment:.0%}"
    ttft, tpot = f"{_ms(p.ttft_p50_s)}/{_ms(p.ttft_p90_s)}", f"{_ms(p.tpot_p50_s)}/{_ms(p.tpot_p90_s)}"
    return f"goodput {p.goodput:.2f} req/s ({meet}); TTFT p50/p90 {ttft} ms, TPOT p50/p90 {tpot} ms"


def _lengths(name: str, s: dict) -> str:
    return f"{name} mean {s['mean']:.0f}, p50/p90/p99 {s['p50']:.0f}/{s['p90']:.0f}/{s['p99']:.0f}"


def render(plan: Plan, profile, path: str, top: int = 10) -> str:
    """The plan as text: what to run, why, and the ranked alternatives."""
    w, unit = plan.workload, plan.unit
    arrivals = "Poisson" if w["burstiness"] == 1 else f"burstiness {w['burstiness']:g}"
    m, h = profile.model, profile.host
    lines = [
        f"profile {path}: {m.model_type} {Path(m.path).name} ({m.dtype}), {h.cpu}, torch {h.torch}, {profile.created}",
        f"workload: {w['rate']:.3g} req/s ({arrivals}), {w['source']}",
        f"  {_lengths('ISL', w['isl'])}; {_lengths('OSL', w['osl'])}",
        f"SLOs: TTFT <= {plan.slos.ttft_s * 1e3:g} ms, TPOT <= {plan.slos.tpot_s * 1e3:g} ms; budget {plan.budget} "
        f"{unit}; {plan.requests} simulated requests (seed {plan.seed})",
    ]
    measured = profile.plane.cpu_s_per_request > 0 or profile.plane.cpu_s_per_token > 0
    if plan.plane_cores is not None and not measured:
        lines.append("serving plane: its CPU is not in this profile (`pdserve profile --serving-plane` measures it)")
    elif plan.plane_cores is not None:
        lines.append(f"serving plane: {plan.plane_cores:.2f} cores at this rate, on the budget's cores (the "
                     "workers step slower where it preempts them; --plane-cpu separate: it has its own)")  # fmt: skip
    lines.append("")
    r, target = plan.recommended, f"{plan.attainment_target:.0%}"
    lines += [f"recommended: {r.deployment.name} ({r.units} {unit})", f"  {_line(r)}"]
    if plan.max_rate is not None:
        lines.append(f"  it keeps {target} of requests within both SLOs up to {plan.max_rate:.3g} req/s")
    if plan.fewest_units is None:
        lines.append(f"no deployment within {plan.budget} {unit} keeps {target} of requests within both SLOs here")
    elif plan.fewest_units is not r:
        f = plan.fewest_units
        lines.append(f"fewest {unit} keeping {target} within both SLOs: {f.deployment.name} ({f.units} {unit}), "
                     f"goodput {f.goodput:.2f} req/s")  # fmt: skip
    co, dis = plan.best_colocated, plan.best_disaggregated
    if co is not None and dis is not None:
        verdict = "colocated would do better" if plan.colocated_better else "disaggregated does at least as well"
        ratio = f"{co.goodput / dis.goodput:.2f}x" if dis.goodput > 0 else "n/a"
        lines.append(f"colocated: best {co.deployment.name}, goodput {co.goodput:.2f} req/s, {ratio} the best "
                     f"disaggregated ({dis.deployment.name}, {dis.goodput:.2f}): {verdict}")  # fmt: skip
    head = f"{'rank':>4}  {'deployment':<40}{unit:>6}{'goodput':>9}{'meet':>6}{'TTFT p50/p90 ms':>17}"
    lines += ["", head + f"{'TPOT p50/p90 ms':>17}"]
    for i, p in enumerate(plan.alternatives[:top], start=1):
        name = p.deployment.name + (" *" if p is r else "")
        ttft, tpot = f"{_ms(p.ttft_p50_s)}/{_ms(p.ttft_p90_s)}", f"{_ms(p.tpot_p50_s)}/{_ms(p.tpot_p90_s)}"
        lines.append(f"{i:>4}  {name:<40}{p.units:>6}{p.goodput:>9.2f}{p.attainment:>6.0%}{ttft:>17}{tpot:>17}")
    if len(plan.alternatives) > top:
        lines.append(f"      ... {len(plan.alternatives) - top} more (--top N, or --json)")
    return "\n".join(lines) + "\n"
