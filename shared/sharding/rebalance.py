"""Live re-placement policy (torch-free): from a group's current expert placement and its recent expert load,
whether to move to a new one, and which slots change.

A new placement from the planner (placement.py `plan_placement`) lists each rank's experts in packing order;
`align` keeps every expert a rank holds in both at its old slot, so only the slots whose expert really changes
move (slot order within a rank means nothing to the dispatch: expert_parallel.py maps experts to slots).

The predicted imbalance of a placement under a load is what a step waits for: per sparse layer the busiest
rank's tokens (replicas splitting their expert's tokens evenly), summed over the layers, over the summed mean
rank load (1.0 = balanced). A rebalance is worth it when the new placement lowers that by at least `min_gain`
relative to the current one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.sharding.placement import ExpertPlacement, PlacementError, plan_placement, rank_loads


@dataclass(frozen=True)
class SlotChange:
    """One slot that takes another expert: rank `dst`'s slot `slot` gets `expert`'s weights from rank `src`."""

    layer: int
    dst: int
    slot: int
    expert: int
    src: int


@dataclass(frozen=True)
class Rebalance:
    """A decided move: the target placement (aligned to the current one), the slots that change, and the
    predicted imbalance before and after."""

    target: ExpertPlacement
    changes: tuple[SlotChange, ...]
    before: float
    after: float

    @property
    def layers(self) -> list[int]:
        """The layers with at least one changed slot, ascending."""
        return sorted({c.layer for c in self.changes})

    @property
    def gain(self) -> float:
        return 1.0 - self.after / self.before if self.before > 0 else 0.0


def predicted_imbalance(placement: ExpertPlacement, stats: dict[int, list[int]]) -> float:
    """Σ over layers of the busiest rank's tokens over Σ of the mean rank's (1.0 without load)."""
    loads = rank_loads(placement, stats)
    busiest = sum(max(per_rank) for per_rank in loads.values())
    mean = sum(sum(per_rank) / len(per_rank) for per_rank in loads.values())
    return busiest / mean if mean > 0 else 1.0


def align(current: list[list[int]], planned: list[list[int]]) -> list[list[int]]:
    """`planned`'s experts per rank, each expert a rank already holds kept at its current slot, the new ones
    in the freed slots (in planned order). Both list the same number of slots per rank."""
    out = []
    for old, new in zip(current, planned, strict=True):
        if len(old) != len(new):
            raise PlacementError(f"a rank holds {len(old)} slots now and {len(new)} in the plan: they must be equal")
        incoming = [e for e in new if e not in old]
        kept = set(new)
        out.append([e if e in kept else incoming.pop(0) for e in old])
    return out


def slot_changes(current: ExpertPlacement, target: ExpertPlacement) -> tuple[SlotChange, ...]:
    """Every slot whose expert differs, over the layers (`layer_changes`)."""
    return tuple(
        c for layer in sorted(target.layers) for c in layer_changes(layer, current.layers[layer], target.layers[layer])
    )


def layer_changes(layer: int, old: list[list[int]], new: list[list[int]]) -> list[SlotChange]:
    """One layer's slots whose expert differs, with the rank each is copied from: a current holder of the expert
    (after `align` never the receiving rank), the one sending the fewest so far (ties: the lowest rank), so
    senders share the work. Deterministic: every rank computes the same from the same placements."""
    holders: dict[int, list[int]] = {}
    for rank, slots in enumerate(old):
        for e in slots:
            holders.setdefault(e, []).append(rank)
    sends = [0] * len(old)
    changes = []
    for dst, slots in enumerate(new):
        for slot, expert in enumerate(slots):
            if old[dst][slot] == expert:
                continue
            candidates = [r for r in holders.get(expert, []) if r != dst]
            if not candidates:
                raise PlacementError(f"layer {layer}: rank {dst} needs expert {expert}, which no other rank holds")
            src = min(candidates, key=lambda r: (sends[r], r))
            sends[src] += 1
            changes.append(SlotChange(layer, dst, slot, expert, src))
    return changes


def decide(current: ExpertPlacement, stats: dict[int, list[int]], redundant: int, min_gain: float) -> Rebalance | None:
    """The rebalance to make, or None: no load yet, nothing would change, or the predicted gain is below
    `min_gain`. The plan keeps the current number of slots per rank (the group allocated them at load)."""
    if not any(sum(counts) for counts in stats.values()):
        return None
    planned = plan_placement(stats, current.ep, redundant, current.num_experts)
    if planned.slots_per_rank != current.slots_per_rank:
        raise PlacementError(
            f"the plan holds {planned.slots_per_rank} slots per rank, the group {current.slots_per_rank}: "
            f"--eplb-redundant must match the slots the group was loaded with"
        )
    target = ExpertPlacement(
        current.ep,
        current.num_experts,
        {layer: align(current.layers[layer], planned.layers[layer]) for layer in current.layers},
    )
    changes = slot_changes(current, target)
    if not changes:
        return None
    before, after = predicted_imbalance(current, stats), predicted_imbalance(target, stats)
    rebalance = Rebalance(target, changes, before, after)
    return rebalance if rebalance.gain >= min_gain and after < before else None


def initial_placement(num_experts: int, ep: int, layers: list[int], redundant: int) -> ExpertPlacement:
    """What a group re-placing live starts from: with no redundant slot the contiguous default, else the
    planner's placement for no load (every rank the same number of slots, `redundant` replicas in all)."""
    if redundant == 0:
        return ExpertPlacement.default(num_experts, ep, layers)
    return plan_placement({layer: [0] * num_experts for layer in layers}, ep, redundant, num_experts)
