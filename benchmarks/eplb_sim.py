"""Expert placement beyond this machine, by simulation: replay expert routing traces (recorded by workers with
`--record-expert-trace`, or synthesised with hot experts that move and skews that change) and compute, per
phase (prefill and decode separately), the busiest EP rank's load over the mean rank's, step by step, for EP
degrees and expert counts this machine cannot run (DeepSeek-V3 serving: 256 routed experts, top-8, over 8–64
ranks).

    PYTHONPATH=. python benchmarks/eplb_sim.py                       # synthetic, DeepSeek-V3-like sizes
    PYTHONPATH=. python benchmarks/eplb_sim.py --trace prefill.jsonl decode.jsonl --ep 2 4

Placements compared, each applied to each phase's own steps:

- `default`: the placement a group starts with (rebalance.py `initial_placement`: the contiguous split, or with
  redundant slots the planner's for no load), never changed.
- `static-shared`: one placement planned from both phases' load summed over the whole trace (what the peers'
  EPLB sees on an instance serving both), applied to each phase. Hindsight: it knows the whole trace.
- `static-own`: each phase's placement planned from its own whole trace (per-phase, static, hindsight).
- `live-shared`: live re-placement from one window fed by both phases' steps in time order (a mixed instance's
  EPLB), the placement serving both.
- `live-own`: live per-phase re-placement (`--eplb`): each phase's window holds its own steps.

The planner (placement.py `plan_placement`) and the live policy (rebalance.py `decide`: plan with the group's
slots, align to the serving placement, apply only if the predicted busiest/mean drops by `min_gain`) are the
live feature's own, imported. What the worker's `ExpertRebalancer` adds around them is reproduced here with
trace time for its clock: a window of the last `window_steps` steps, a plan at most every `interval_s` (and
none while a move is in flight), and a move that stages `stage_layers` changed layers per step boundary and swaps
at the next: a plan decided before step i serves from step i + ceil(changed layers / stage_layers) + 1.

Figures per phase and placement: `imbalance` = Σ over steps and layers of the busiest rank's tokens / Σ of the
mean rank's (what the MoE layers wait for relative to a perfect split, weighted by tokens: the form of
`pdserve:moe_rank_imbalance`), `step_mean` the plain mean of each step's ratio (decode steps count as much as
prefill ones), `p90` of the step ratios, and for live placements the rebalances and slots moved. The JSON keeps
the imbalance over time (per tenth of the trace) too.

Synthetic traces: `--segments` traffic phases of `--segment-s` seconds; in each, every layer's experts are
ranked by a fresh random permutation per phase (prefill and decode: decode's permutation is prefill's with a
share 1 - `--overlap` of positions swapped at random) and drawn with Zipf weights 1/rank^s, s from `--skews`
(decode takes them in reverse order), capped at 1/top_k (a token picks an expert once) and renormalised.
A step's counts are a multinomial draw of tokens x top_k pairs: per-step sampling noise is in the trace, as in
a real decode step's few tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from shared.engine.config import EplbConfig  # noqa: E402
from shared.sharding.expert_trace import read_trace  # noqa: E402
from shared.sharding.placement import ExpertPlacement, plan_placement  # noqa: E402
from shared.sharding.rebalance import decide, initial_placement  # noqa: E402

ROLES = ("prefill", "decode")
# Zipf exponents of the traffic phases: over 256 experts s = 0.3 makes the hottest expert ~2.6x the mean expert's
# load, 0.7 ~15x (before the 1/top_k cap)
SKEWS = (0.3, 0.6, 0.4, 0.7)
POLICIES = ("default", "static-shared", "static-own", "live-shared", "live-own")


@dataclass
class PhaseTrace:
    """One phase's steps as arrays: counts (steps, layers, experts) and each step's end time (seconds)."""

    role: str
    layers: list[int]
    counts: np.ndarray  # (S, L, E) int
    t: np.ndarray  # (S,) float, ascending

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    def load(self, steps: slice | np.ndarray | None = None) -> dict[int, list[int]]:
        c = self.counts if steps is None else self.counts[steps]
        total = c.sum(axis=0)
        return {layer: [int(x) for x in total[i]] for i, layer in enumerate(self.layers)}


# ---- traces ---------------------------------------------------------------------------------------------------


def from_files(paths: list[str]) -> dict[str, PhaseTrace]:
    """Recorded traces by role: every segment of a role (several files, restarts) in time order. A mixed
    worker's steps count as both phases' (it serves both in one step)."""
    by_role: dict[str, list] = {}
    header = None
    for path in paths:
        for trace in read_trace(path):
            if header is None:
                header = trace.header
            elif (trace.header.layers, trace.header.num_experts) != (header.layers, header.num_experts):
                raise SystemExit(f"{path}: traces of different models (layers or expert counts differ)")
            by_role.setdefault(trace.role, []).extend(trace.steps)
    if header is None:
        raise SystemExit(f"no traces in {paths}")
    out = {}
    for role, steps in by_role.items():
        steps.sort(key=lambda s: s.t)
        counts = np.array([s.counts for s in steps], dtype=np.int64)
        out[role] = PhaseTrace(role, list(header.layers), counts, np.array([s.t for s in steps]))
    return out


def zipf_weights(order: np.ndarray, s: float, top_k: int) -> np.ndarray:
    """Per expert, 1/(rank+1)^s by its rank in `order`, normalised, then capped at 1/top_k (a token picks an
    expert at most once: no expert can take more than 1/top_k of the pairs) with the excess spread over the rest."""
    w = np.empty(len(order))
    w[order] = 1.0 / np.arange(1, len(order) + 1) ** s
    w /= w.sum()
    cap = 1.0 / top_k
    for _ in range(len(w)):
        over = w > cap + 1e-12
        if not over.any():
            break
        excess = (w[over] - cap).sum()
        w[over] = cap
        free = ~over & (w < cap)
        w[free] += excess * w[free] / w[free].sum()
    return w


@dataclass
class Synthetic:
    num_experts: int = 256
    top_k: int = 8
    layers: int = 4
    segments: int = 4
    segment_s: float = 300.0
    skews: tuple[float, ...] = SKEWS
    overlap: float = 0.5
    prefill_tokens: int = 16384
    prefill_step_s: float = 0.5
    decode_tokens: int = 1024
    decode_step_s: float = 0.1
    seed: int = 0
    roles: dict[str, tuple[int, float]] = field(init=False)

    def __post_init__(self) -> None:
        self.roles = {
            "prefill": (self.prefill_tokens, self.prefill_step_s),
            "decode": (self.decode_tokens, self.decode_step_s),
        }

    def generate(self) -> dict[str, PhaseTrace]:
        rng = np.random.default_rng(self.seed)
        e, k = self.num_experts, self.top_k
        orders = {}  # (segment, layer) → (prefill order, decode order)
        for seg in range(self.segments):
            for layer in range(self.layers):
                pre = rng.permutation(e)
                dec = pre.copy()
                for i in range(e):  # decode favours partly the same experts: swap a share of positions
                    if rng.random() >= self.overlap:
                        j = rng.integers(e)
                        dec[i], dec[j] = dec[j], dec[i]
                orders[seg, layer] = (pre, dec)
        out = {}
        for r, (role, (tokens, step_s)) in enumerate(self.roles.items()):
            steps_per_seg = max(1, int(round(self.segment_s / step_s)))
            total = steps_per_seg * self.segments
            counts = np.empty((total, self.layers, e), dtype=np.int32)
            skews = self.skews if role == "prefill" else tuple(reversed(self.skews))
            for seg in range(self.segments):
                s = skews[seg % len(skews)]
                for layer in range(self.layers):
                    p = zipf_weights(orders[seg, layer][r], s, k)
                    rows = slice(seg * steps_per_seg, (seg + 1) * steps_per_seg)
                    counts[rows, layer] = rng.multinomial(tokens * k, p, size=steps_per_seg)
            t = np.arange(1, total + 1) * step_s
            out[role] = PhaseTrace(role, list(range(self.layers)), counts, t)
        return out


# ---- evaluation -----------------------------------------------------------------------------------------------


def share_matrix(placement: ExpertPlacement, layers: list[int]) -> np.ndarray:
    """(L, E, R): the share of expert e's tokens rank r computes (1/replicas where it holds a replica)."""
    e, ranks = placement.num_experts, placement.ep
    m = np.zeros((len(layers), e, ranks))
    for i, layer in enumerate(layers):
        for r, slots in enumerate(placement.layers[layer]):
            m[i, slots, r] = 1.0
        held = m[i].sum(axis=1, keepdims=True)
        m[i] /= np.maximum(held, 1.0)
    return m


def step_loads(counts: np.ndarray, placement: ExpertPlacement, layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per step: Σ over layers of the busiest rank's tokens, and of the mean rank's, under `placement`."""
    m = share_matrix(placement, layers)
    busiest = np.zeros(len(counts))
    mean = np.zeros(len(counts))
    for i in range(len(layers)):
        per_rank = counts[:, i, :].astype(np.float64) @ m[i]  # (S, R)
        busiest += per_rank.max(axis=1)
        mean += per_rank.sum(axis=1) / placement.ep
    return busiest, mean


@dataclass
class Outcome:
    busiest: np.ndarray  # (S,) per step
    mean: np.ndarray
    rebalances: int = 0
    slots_moved: int = 0

    def summary(self, buckets: int = 10) -> dict:
        ratio = np.divide(self.busiest, self.mean, out=np.ones_like(self.busiest), where=self.mean > 0)
        over_time = []
        for part in np.array_split(np.arange(len(ratio)), min(buckets, len(ratio))):
            b, m = self.busiest[part].sum(), self.mean[part].sum()
            over_time.append(round(float(b / m), 4) if m > 0 else 1.0)
        return {
            "imbalance": round(float(self.busiest.sum() / self.mean.sum()), 4) if self.mean.sum() > 0 else 1.0,
            "step_mean": round(float(ratio.mean()), 4),
            "p90": round(float(np.percentile(ratio, 90)), 4),
            "rebalances": self.rebalances,
            "slots_moved": self.slots_moved,
            "over_time": over_time,
        }


def static(trace: PhaseTrace, placement: ExpertPlacement) -> Outcome:
    return Outcome(*step_loads(trace.counts, placement, trace.layers))


def live(traces: dict[str, PhaseTrace], feeding: list[str], start: ExpertPlacement, eplb: EplbConfig) -> dict:
    """Live re-placement over the steps of the `feeding` phases in time order (one phase: per-phase; both: a
    shared instance), evaluated on each feeding phase's own steps. → role → Outcome."""
    events = sorted(((float(traces[r].t[i]), j, i) for j, r in enumerate(feeding) for i in range(len(traces[r].t))))
    layers = traces[feeding[0]].layers
    placements = [start]
    used = {r: np.zeros(len(traces[r].t), dtype=np.int64) for r in feeding}  # step → placement index
    window: deque[np.ndarray] = deque()
    window_sum = np.zeros(traces[feeding[0]].counts.shape[1:], dtype=np.int64)
    last_plan = events[0][0] if events else 0.0
    pending: tuple[int, ExpertPlacement] | None = None  # (boundary it swaps at, target)
    rebalances = slots = 0
    clock = last_plan
    for n, (t, j, i) in enumerate(events):
        # the boundary before this step: the rebalancer's between_steps, with the previous step's end as clock
        if pending is not None:
            if n >= pending[0]:
                placements.append(pending[1])
                pending = None
        elif window and clock - last_plan >= eplb.interval_s:
            load = {layer: [int(x) for x in window_sum[li]] for li, layer in enumerate(layers)}
            plan = decide(placements[-1], load, eplb.redundant, eplb.min_gain)
            last_plan = clock
            if plan is not None:
                # eplb.stage_layers changed layers staged per boundary (0: all at one), then the swap
                boundaries = -(-len(plan.layers) // eplb.stage_layers) if eplb.stage_layers else 1
                pending = (n + boundaries + 1, plan.target)
                rebalances += 1
                slots += len(plan.changes)
        role = feeding[j]
        used[role][i] = len(placements) - 1
        counts = traces[role].counts[i]
        window.append(counts)
        window_sum += counts
        if len(window) > eplb.window_steps:
            window_sum -= window.popleft()
        clock = t
    out = {}
    for role in feeding:
        trace = traces[role]
        busiest, mean = np.zeros(len(trace.t)), np.zeros(len(trace.t))
        for p in np.unique(used[role]):
            rows = used[role] == p
            busiest[rows], mean[rows] = step_loads(trace.counts[rows], placements[p], trace.layers)
        out[role] = Outcome(busiest, mean, rebalances, slots)
    return out


def compare(
    traces: dict[str, PhaseTrace], ep: int, redundant: int, eplb: EplbConfig, own: dict[str, EplbConfig] | None = None
) -> dict:
    """Every placement policy on every phase at one EP degree → policy → role → summary. `own`: a phase's live
    settings where they differ from `eplb` (each role's workers take their own flags)."""
    any_trace = next(iter(traces.values()))
    layers, e = any_trace.layers, any_trace.num_experts
    start = initial_placement(e, ep, layers, redundant)
    roles = [r for r in ROLES if r in traces] or list(traces)
    summed = {layer: [0] * e for layer in layers}
    for trace in traces.values():
        for layer, counts in trace.load().items():
            summed[layer] = [a + b for a, b in zip(summed[layer], counts, strict=True)]
    shared = plan_placement(summed, ep, redundant, e)
    out: dict[str, dict] = {p: {} for p in POLICIES}
    for role in roles:
        out["default"][role] = static(traces[role], start).summary()
        out["static-shared"][role] = static(traces[role], shared).summary()
        planned = plan_placement(traces[role].load(), ep, redundant, e)
        out["static-own"][role] = static(traces[role], planned).summary()
        settings = (own or {}).get(role, eplb)
        out["live-own"][role] = live(traces, [role], start, settings)[role].summary()
    if len(roles) > 1:
        for role, outcome in live(traces, roles, start, eplb).items():
            out["live-shared"][role] = outcome.summary()
    else:
        del out["live-shared"]
    return out


# ---- the command ----------------------------------------------------------------------------------------------


def print_table(title: str, result: dict) -> None:
    roles = sorted({r for per in result.values() for r in per}, key=lambda r: (ROLES + (r,)).index(r))
    print(f"\n{title}")
    print(f"  {'placement':<14}" + "".join(f" | {r + ' busiest/mean (step mean, p90)':<38}" for r in roles))
    for policy, per in result.items():
        cells = []
        for r in roles:
            s = per.get(r)
            moved = f" {s['rebalances']}x" if s and policy.startswith("live") else ""
            cells.append(f"{s['imbalance']:.3f} ({s['step_mean']:.3f}, {s['p90']:.3f}){moved}" if s else "-")
        print(f"  {policy:<14}" + "".join(f" | {c:<38}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", nargs="*", default=None, help="recorded trace files (default: synthesise)")
    parser.add_argument("--experts", type=int, nargs="*", default=[64, 128, 256], help="synthetic experts")
    parser.add_argument("--top-k", type=int, nargs="*", default=None, help="per --experts (default 6, 8, 8...)")
    parser.add_argument("--ep", type=int, nargs="*", default=[8, 16, 32, 64], help="EP degrees")
    parser.add_argument("--redundant", default="ep", help="redundant slots per layer: a number, or 'ep' (one per rank)")
    parser.add_argument("--layers", type=int, default=4, help="synthetic sparse layers")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--segment-s", type=float, default=Synthetic.segment_s)
    parser.add_argument("--skews", type=float, nargs="*", default=list(SKEWS))
    parser.add_argument("--overlap", type=float, default=0.5, help="how far decode's hot experts are prefill's")
    parser.add_argument("--prefill-tokens", type=int, default=Synthetic.prefill_tokens, help="per group step")
    parser.add_argument("--decode-tokens", type=int, default=Synthetic.decode_tokens, help="per group step")
    parser.add_argument("--seed", type=int, default=0)
    defaults = EplbConfig()
    parser.add_argument("--window-steps", type=int, default=defaults.window_steps)
    parser.add_argument(
        "--prefill-window-steps", type=int, default=None, help="live-own prefill's window (default: --window-steps)"
    )
    parser.add_argument("--interval-s", type=float, default=defaults.interval_s)
    parser.add_argument("--min-gain", type=float, default=defaults.min_gain)
    parser.add_argument("--stage-layers", type=int, default=defaults.stage_layers, help="0: every layer at once")
    parser.add_argument("--out", default="eplb_sim.json")
    args = parser.parse_args()

    began = time.monotonic()
    runs = []
    if args.trace:
        sources = [("recorded", from_files(args.trace))]
    else:
        top_ks = args.top_k or [6 if e <= 64 else 8 for e in args.experts]
        sources = []
        for e, k in zip(args.experts, top_ks, strict=True):
            synth = Synthetic(
                num_experts=e,
                top_k=k,
                layers=args.layers,
                segments=args.segments,
                segment_s=args.segment_s,
                skews=tuple(args.skews),
                overlap=args.overlap,
                prefill_tokens=args.prefill_tokens,
                decode_tokens=args.decode_tokens,
                seed=args.seed,
            )
            sources.append((f"synthetic E={e} top-{k}", synth.generate()))
    for name, traces in sources:
        e = next(iter(traces.values())).num_experts
        for ep in args.ep:
            redundant = ep if args.redundant == "ep" else int(args.redundant)
            if ep > e or (e + redundant) % ep:
                print(f"\n{name}: ep={ep} skipped ({e} experts + {redundant} redundant do not split over {ep})")
                continue
            eplb = EplbConfig(
                enabled=True,
                window_steps=args.window_steps,
                interval_s=args.interval_s,
                redundant=redundant,
                min_gain=args.min_gain,
                stage_layers=args.stage_layers,
            )
            own = {}
            if args.prefill_window_steps:
                own["prefill"] = dataclasses.replace(eplb, window_steps=args.prefill_window_steps)
            result = compare(traces, ep, redundant, eplb, own)
            steps = {r: int(len(t.t)) for r, t in traces.items()}
            print_table(f"{name}, ep={ep}, {redundant} redundant slots, steps {steps}", result)
            runs.append({"trace": name, "experts": e, "ep": ep, "redundant": redundant, "steps": steps, **result})
    record = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "seconds": round(time.monotonic() - began, 1),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {args.out} ({record['seconds']} s)")


if __name__ == "__main__":
    main()
