"""Expert placement: which logical experts each expert-parallel rank holds, per sparse layer, with optional
redundant replicas of hot experts (the EPLB idea), and the planner that computes one from expert-load
statistics.

A placement gives, per layer and per rank, the logical expert of each of the rank's physical slots. Every
rank has the same number of slots (E + redundant) / ep; every expert is on at least one rank; a rank never
holds two replicas of one expert. Replicas of an expert split its tokens (by token index, see
shared/model/expert_parallel.py), so the planner estimates a replica's load as the expert's load / replicas.

Input statistics: a JSON file `{layer: [tokens per expert]}` or a Prometheus text scrape of a worker's
/metrics (`pdserve:moe_expert_tokens_total{layer=..., expert=...}`, shared/telemetry/metrics.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from shared.sharding.layout import LayoutError, expert_range

METRIC = "pdserve:moe_expert_tokens_total"  # the Counter MOE_EXPERT_TOKENS as exported (`_total` added)


class PlacementError(ValueError):
    """A placement file or statistics that do not fit (the message names the mismatch)."""


@dataclass(frozen=True)
class ExpertPlacement:
    ep: int
    num_experts: int
    layers: dict[int, list[list[int]]]  # sparse layer → per rank → logical expert of each slot

    def __post_init__(self) -> None:
        for layer, ranks in self.layers.items():
            _check_layer(layer, ranks, self.ep, self.num_experts)

    @classmethod
    def default(cls, num_experts: int, ep: int, layers: list[int]) -> ExpertPlacement:
        """No replicas: rank r holds expert_range(E, ep, r) in every layer."""
        ranks = [list(expert_range(num_experts, ep, r)) for r in range(ep)]
        return cls(ep, num_experts, {layer: [list(s) for s in ranks] for layer in layers})

    @property
    def slots_per_rank(self) -> int:
        first = next(iter(self.layers.values()), None)
        return len(first[0]) if first else self.num_experts // self.ep

    def slots(self, layer: int, rank: int) -> list[int]:
        return self.layers[layer][rank]

    def check_model(self, num_experts: int, sparse_layers: list[int], ep: int) -> None:
        """Refuse a placement planned for another model or group, naming what differs."""
        if self.ep != ep:
            raise PlacementError(f"the expert placement is for ep={self.ep}, this worker group has ep={ep}")
        if self.num_experts != num_experts:
            raise PlacementError(
                f"the expert placement is for {self.num_experts} experts per layer, the model has {num_experts}"
            )
        if sorted(self.layers) != sorted(sparse_layers):
            raise PlacementError(
                f"the expert placement covers layers {sorted(self.layers)}, the model's sparse layers are "
                f"{sorted(sparse_layers)}"
            )

    def to_json(self) -> dict:
        return {
            "ep": self.ep,
            "num_experts": self.num_experts,
            "layers": {str(layer): ranks for layer, ranks in sorted(self.layers.items())},
        }

    @classmethod
    def from_json(cls, data: dict) -> ExpertPlacement:
        try:
            layers = {int(k): [[int(e) for e in slots] for slots in v] for k, v in data["layers"].items()}
            return cls(int(data["ep"]), int(data["num_experts"]), layers)
        except (KeyError, TypeError, AttributeError) as exc:
            raise PlacementError(f"not an expert placement (need ep, num_experts, layers): {exc!r}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ExpertPlacement:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise PlacementError(f"{path}: not JSON: {exc}") from exc
        try:
            return cls.from_json(data)
        except PlacementError as exc:
            raise PlacementError(f"{path}: {exc}") from exc


def _check_layer(layer: int, ranks: list[list[int]], ep: int, num_experts: int) -> None:
    where = f"layer {layer}"
    if len(ranks) != ep:
        raise PlacementError(f"{where}: {len(ranks)} ranks listed, ep={ep}")
    sizes = {len(slots) for slots in ranks}
    if len(sizes) != 1:
        raise PlacementError(f"{where}: ranks hold different numbers of slots {sorted(sizes)}; they must be equal")
    for rank, slots in enumerate(ranks):
        if len(set(slots)) != len(slots):
            raise PlacementError(f"{where}: rank {rank} holds an expert twice ({slots})")
        bad = [e for e in slots if not 0 <= e < num_experts]
        if bad:
            raise PlacementError(f"{where}: rank {rank} names expert(s) {bad}, the model has {num_experts}")
    missing = sorted(set(range(num_experts)) - {e for slots in ranks for e in slots})
    if missing:
        raise PlacementError(f"{where}: expert(s) {missing} are on no rank")


# ---- statistics -------------------------------------------------------------------------------------------


def parse_stats(text: str, role: str | None = None) -> dict[int, list[int]]:
    """Per-layer expert token counts from a JSON `{layer: [count per expert]}` or a Prometheus text scrape
    (every `pdserve:moe_expert_tokens_total` series summed over its other labels: roles, models; only the series
    of `role` when given)."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            raw = json.loads(text)
            return {int(layer): [int(round(float(c))) for c in counts] for layer, counts in raw.items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise PlacementError(f"expert statistics JSON must be {{layer: [count per expert]}}: {exc}") from exc
    return _parse_prometheus(text, role)


_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _parse_prometheus(text: str, role: str | None = None) -> dict[int, list[int]]:
    sums: dict[int, dict[int, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or m is None or m["name"] != METRIC:
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        if "layer" not in labels or "expert" not in labels:
            raise PlacementError(f"{METRIC} sample without layer/expert labels: {line!r}")
        if role is not None and labels.get("role") != role:
            continue
        per = sums.setdefault(int(labels["layer"]), {})
        per[int(labels["expert"])] = per.get(int(labels["expert"]), 0.0) + float(m["value"])
    if not sums:
        of = f" of role {role}" if role is not None else ""
        raise PlacementError(f"no {METRIC} samples{of} in the scrape (is it a worker's /metrics of an MoE model?)")
    # the counter only has series for experts that saw tokens: the layer's width is the largest index seen
    width = max(max(per) for per in sums.values()) + 1
    return {layer: [int(round(per.get(e, 0.0))) for e in range(width)] for layer, per in sorted(sums.items())}


# ---- the planner ------------------------------------------------------------------------------------------


def plan_placement(
    stats: dict[int, list[int]], ep: int, redundant: int, num_experts: int | None = None
) -> ExpertPlacement:
    """Per layer: choose how many replicas each expert gets (the `redundant` extra slots, at most ep replicas
    each: a few choices, `_plan_layer`), pack the replicas heaviest first onto the least-loaded rank that has a
    free slot and does not hold that expert yet, and keep the choice whose busiest rank carries least."""
    if ep < 1 or redundant < 0:
        raise PlacementError(f"need ep >= 1 and redundant >= 0, got ep={ep} redundant={redundant}")
    if not stats:
        raise PlacementError("no expert statistics")
    widths = {len(c) for c in stats.values()}
    e = num_experts if num_experts is not None else max(widths)
    if any(w > e for w in widths):
        raise PlacementError(f"statistics name more experts ({max(widths)}) than the model has ({e})")
    if (e + redundant) % ep:
        raise PlacementError(
            f"{e} experts + {redundant} redundant slots do not split evenly over ep={ep}: "
            f"choose --redundant so that (experts + redundant) is a multiple of ep"
        )
    if redundant > e * (ep - 1):
        raise PlacementError(f"{redundant} redundant slots: at most {e * (ep - 1)} (every expert on every rank)")
    layers = {}
    for layer, counts in stats.items():
        padded = [float(c) for c in counts] + [0.0] * (e - len(counts))
        layers[layer] = _plan_layer(padded, ep, redundant)
    return ExpertPlacement(ep, e, layers)


def replica_counts(load: list[float], redundant: int, ep: int) -> list[int]:
    """The redundant slots one at a time to the expert with the highest load per replica (at most ep each)."""
    replicas = [1] * len(load)
    for _ in range(redundant):
        candidates = [i for i in range(len(load)) if replicas[i] < ep]
        hottest = max(candidates, key=lambda i: (load[i] / replicas[i], -i))
        replicas[hottest] += 1
    return replicas


def capped_replica_counts(load: list[float], redundant: int, ep: int, cap: float) -> list[int]:
    """Replicas enough for no replica to carry more than `cap` (ceil(load / cap), at most ep; the hottest first
    while the redundant slots last), then the slots left to the coldest experts: replicas that carry next to
    nothing, only filling slots. Why: handing every slot to the hottest per replica can give two hot experts a
    replica too many each and force both onto one rank (two experts of half the load over 4 ranks: 3 replicas
    each put both on two ranks, 1.33x the mean; 2 each, one per rank, 1.0x)."""
    replicas = [1] * len(load)
    left = redundant
    for i in sorted(range(len(load)), key=lambda i: (-load[i], i)):
        want = min(ep, max(1, math.ceil(load[i] / cap - 1e-9))) if cap > 0 else 1
        extra = min(want - 1, left)
        replicas[i] += extra
        left -= extra
    for i in sorted(range(len(load)), key=lambda i: (load[i], i)):
        extra = min(ep - replicas[i], left)
        replicas[i] += extra
        left -= extra
    return replicas


def _plan_layer(load: list[float], ep: int, redundant: int) -> list[list[int]]:
    """The best packing of a few replica choices (the busiest rank's load, the greedy choice first on a tie): the
    greedy one (replica_counts), and replicas capped at the mean rank's load and at half of it."""
    per_rank = (len(load) + redundant) // ep
    mean = sum(load) / ep
    choices = [replica_counts(load, redundant, ep)]
    if redundant:
        choices += [capped_replica_counts(load, redundant, ep, cap) for cap in (mean, mean / 2)]
    best: tuple[float, list[list[int]]] | None = None
    for replicas in choices:
        ranks = _pack(load, replicas, ep, per_rank)
        busiest = max(sum(load[e] / replicas[e] for e in slots) for slots in ranks)
        if best is None or busiest < best[0] - 1e-9 * max(mean, 1.0):
            best = (busiest, ranks)
    assert best is not None
    return best[1]


def _pack(load: list[float], replicas: list[int], ep: int, per_rank: int) -> list[list[int]]:
    """The replicas heaviest first onto the least-loaded rank that has a free slot and does not hold that
    expert yet."""
    items = sorted(
        ((load[i] / replicas[i], i) for i in range(len(load)) for _ in range(replicas[i])), key=lambda t: (-t[0], t[1])
    )
    ranks: list[list[int]] = [[] for _ in range(ep)]
    rank_load = [0.0] * ep
    for weight, expert in items:
        free = [r for r in range(ep) if len(ranks[r]) < per_rank and expert not in ranks[r]]
        if not free:  # greedy cornered itself (the last replicas of one expert, free slots on one rank)
            return _pack_by_replicas(load, replicas, ep, per_rank)
        r = min(free, key=lambda r: (rank_load[r], len(ranks[r]), r))
        ranks[r].append(expert)
        rank_load[r] += weight
    return ranks


def _pack_by_replicas(load: list[float], replicas: list[int], ep: int, per_rank: int) -> list[list[int]]:
    """Always feasible: experts with the most replicas first, each onto the ranks with the most free slots
    (ties: least loaded) — the Gale–Ryser order."""
    ranks: list[list[int]] = [[] for _ in range(ep)]
    rank_load = [0.0] * ep
    for expert in sorted(range(len(load)), key=lambda i: (-replicas[i], -load[i], i)):
        chosen = sorted(range(ep), key=lambda r: (len(ranks[r]), rank_load[r], r))[: replicas[expert]]
        for r in chosen:
            if len(ranks[r]) >= per_rank:
                raise LayoutError("expert packing failed: no free slot (a bug: the slot count is checked)")
            ranks[r].append(expert)
            rank_load[r] += load[expert] / replicas[expert]
    return ranks


def rank_loads(placement: ExpertPlacement, stats: dict[int, list[int]]) -> dict[int, list[float]]:
    """Per layer: each rank's expected tokens when replicas split their expert's tokens evenly."""
    out = {}
    for layer, ranks in placement.layers.items():
        counts = stats.get(layer, [])
        replicas = [0] * placement.num_experts
        for slots in ranks:
            for e in slots:
                replicas[e] += 1
        out[layer] = [sum(counts[e] / replicas[e] for e in slots if e < len(counts)) for slots in ranks]
    return out


def imbalance(loads: list[float]) -> float:
    """Most-loaded rank over the mean rank load (1.0 = balanced; 1.0 for no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0
