"""Live, per-phase expert re-placement of an expert-parallel worker group (`--eplb`), on its leader.

Each group plans from its own load: a prefill group's window holds prefill traffic, a decode group's decode
traffic, so each phase gets the placement its load asks for (what the peers' EPLB does per instance, here per
phase). The loop, at the leader's step boundaries (LeaderOps.step calls `between_steps` before announcing a
step and `after_step` after running it):

1. Window: after every step the per-expert token counts the dispatch kept on the device (ExpertParallel
   .expert_tokens; every rank routes alike, so the leader's are the group's) go into a ring of the last
   `window_steps` steps, (steps, sparse layers, E) int64 on the model's device: no host read per step.
2. Plan: at most once per `interval_s` (or when `request`ed), the window's sum is read once and the existing
   planner (shared/sharding/placement.py) proposes a placement with the group's slots; shared/sharding/
   rebalance.py keeps it only if the predicted busiest-rank / mean load drops by `min_gain` and lists the slots
   that change. The leader decides alone and tells the followers the result: all ranks act identically.
3. Stage: `stage_layers` changed layers per step boundary (1 by default; 0: all), an op of the stream each
   (`eplb_stage`): every rank sends and receives a layer's changed slots in one all_to_all (shared/model/
   expert_moves.py) into spare buffers. The old placement keeps serving: a step waits for at most that many
   layers' moves.
4. Swap: once every changed layer is staged on every rank, one `eplb_swap` op makes every rank copy its staged
   slots in and switch its dispatch tables, at the same point of the stream: the next step runs the new
   placement everywhere. A rank dying before then fails the group's collective (or its watch ends the
   group): the group goes down with the old placement, never a half-placed one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.engine.config import EplbConfig
from shared.model.expert_moves import slot_bytes
from shared.model.expert_parallel import ExpertParallel
from shared.model.transformer import CausalLM
from shared.sharding.placement import ExpertPlacement
from shared.sharding.rebalance import Rebalance, align, decide, predicted_imbalance, slot_changes
from shared.telemetry import tracing

if TYPE_CHECKING:
    from shared.parallel.ops import LeaderOps

log = logging.getLogger(__name__)

EPLB_REBALANCE = "eplb_rebalance"  # the span of one rebalance: decided → swapped on every rank


@dataclass
class EplbStats:
    """What live re-placement did since the last `take_stats` (the worker's heartbeat records it)."""

    rebalances: int = 0
    bytes_moved: int = 0  # expert weights sent between ranks
    pauses_s: list[float] = field(default_factory=list)  # each step boundary's stage or swap
    window_imbalance: float | None = None  # the current placement's predicted busiest / mean, at the last plan


class ExpertLoadWindow:
    """The last `steps` steps' tokens per (sparse layer, logical expert), a ring on the counters' device."""

    def __init__(self, dispatches: dict[int, ExpertParallel], steps: int) -> None:
        self.layers = sorted(dispatches)
        self._dispatches = [dispatches[layer] for layer in self.layers]
        self._steps = steps
        self._ring: torch.Tensor | None = None  # allocated at the first record, on the counters' device
        self._next = 0
        self.filled = 0  # steps recorded, up to `steps`

    def clear_counters(self) -> None:
        for d in self._dispatches:
            d.expert_tokens.zero_()

    def record(self) -> None:
        """One step's counts into the ring (device ops only); the counters restart."""
        counts = torch.stack([d.expert_tokens for d in self._dispatches])  # (L, E)
        if self._ring is None or self._ring.device != counts.device:
            self._ring = torch.zeros(self._steps, *counts.shape, dtype=torch.int64, device=counts.device)
        self._ring[self._next].copy_(counts)
        self.clear_counters()
        self._next = (self._next + 1) % self._steps
        self.filled = min(self.filled + 1, self._steps)

    def load(self) -> dict[int, list[int]]:
        """Layer → tokens per expert over the window (one host read)."""
        if self._ring is None:
            return {}
        total = self._ring.sum(0).cpu().tolist()
        return dict(zip(self.layers, total, strict=True))


@dataclass
class _Move:
    """A rebalance in progress: the layers still to stage, the span and the clock of it."""

    plan: Rebalance
    pending: list[int]
    span: tracing.trace.Span
    started: float


class ExpertRebalancer:
    """The leader's live re-placement: window, planner and the move's state machine (module docstring)."""

    def __init__(self, config: EplbConfig, model: CausalLM, model_name: str, clock=time.monotonic) -> None:
        dispatches = {i: m.dispatch for i, m in model.sparse_layers().items() if m.dispatch is not None}
        if not dispatches:
            raise ValueError("--eplb needs an expert-parallel model (sparse layers with an EP dispatch)")
        self.config, self.model, self.model_name, self._clock = config, model, model_name, clock
        self._moes = {i: model.sparse_layers()[i] for i in dispatches}
        self._dispatches = dispatches
        self.window = ExpertLoadWindow(dispatches, config.window_steps)
        self.window.clear_counters()  # what routed before (the KV budget's measurement run) is no traffic
        self._last_plan = clock()
        self._forced: ExpertPlacement | bool = False
        self._move: _Move | None = None
        self._stats = EplbStats()
        self.history: list[Rebalance] = []  # every rebalance swapped in, oldest first (tests, logs)

    @property
    def placement(self) -> ExpertPlacement:
        """The placement serving now (every rank's slots per layer, as the dispatch tables hold it)."""
        num_experts = next(iter(self._dispatches.values())).num_experts
        ep = next(iter(self._dispatches.values())).group.world
        return ExpertPlacement(ep, num_experts, {i: d.ranks for i, d in self._dispatches.items()})

    @property
    def moving(self) -> bool:
        return self._move is not None

    def request(self, target: ExpertPlacement | None = None) -> None:
        """Plan at the next step boundary whatever the interval (and the minimum gain): from the window, or move
        to `target` (aligned to the current slots) — tests and operators forcing a rebalance."""
        self._forced = target if target is not None else True

    def take_stats(self) -> EplbStats:
        stats, self._stats = self._stats, EplbStats(window_imbalance=self._stats.window_imbalance)
        return stats

    def after_step(self) -> None:
        self.window.record()

    def between_steps(self, ops: LeaderOps) -> None:
        """At a step boundary: stage the next layers of a move in progress (config.stage_layers of them), or swap it
        in once all are staged, or plan when due."""
        if self._move is not None:
            started = self._clock()
            if self._move.pending:
                pending = self._move.pending
                count = self.config.stage_layers or len(pending)
                for layer in pending[:count]:
                    ops.stage_experts(layer, self._move.plan.target.layers[layer])
                del pending[:count]
            else:
                ops.swap_experts()
                self._finish()
            self._stats.pauses_s.append(self._clock() - started)
            return
        if self._forced is False and self._clock() - self._last_plan < self.config.interval_s:
            return
        if self.window.filled == 0 and not isinstance(self._forced, ExpertPlacement):
            return
        plan = self._plan()
        self._forced, self._last_plan = False, self._clock()
        if plan is not None:
            self._start(plan)

    def _plan(self) -> Rebalance | None:
        current = self.placement
        load = self.window.load()
        if isinstance(self._forced, ExpertPlacement):
            target = ExpertPlacement(
                current.ep,
                current.num_experts,
                {i: align(current.layers[i], self._forced.layers[i]) for i in current.layers},
            )
            changes = slot_changes(current, target)
            before, after = predicted_imbalance(current, load), predicted_imbalance(target, load)
            self._stats.window_imbalance = before
            return Rebalance(target, changes, before, after) if changes else None
        min_gain = 0.0 if self._forced else self.config.min_gain
        self._stats.window_imbalance = predicted_imbalance(current, load)
        plan = decide(current, load, self.config.redundant, min_gain)
        if plan is None:
            log.debug("eplb: no rebalance (window imbalance %.3f)", self._stats.window_imbalance)
        return plan

    def _start(self, plan: Rebalance) -> None:
        span = tracing.tracer.start_span(
            f"{EPLB_REBALANCE} {self.model_name}",
            attributes={
                "pdserve.eplb.layers": len(plan.layers),
                "pdserve.eplb.slots": len(plan.changes),
                "pdserve.eplb.imbalance_before": plan.before,
                "pdserve.eplb.imbalance_after": plan.after,
            },
        )
        log.info(
            "eplb: rebalancing %d slot(s) in %d layer(s): predicted busiest/mean %.3f -> %.3f (window %d steps)",
            len(plan.changes),
            len(plan.layers),
            plan.before,
            plan.after,
            self.window.filled,
        )
        self._move = _Move(plan, plan.layers, span, self._clock())

    def bytes_of(self, plan: Rebalance) -> int:
        """Bytes a rebalance sends between ranks: each changed slot's weights, once."""
        return sum(slot_bytes(self._moes[c.layer]) for c in plan.changes)

    def _finish(self) -> None:
        move, self._move = self._move, None
        assert move is not None
        moved = self.bytes_of(move.plan)
        self._stats.rebalances += 1
        self._stats.bytes_moved += moved
        self.history.append(move.plan)
        took = self._clock() - move.started
        move.span.set_attribute("pdserve.eplb.bytes", moved)
        move.span.end()
        log.info(
            "eplb: rebalanced %d slot(s), %d bytes moved, over %.3f s (busiest/mean now predicted %.3f)",
            len(move.plan.changes),
            moved,
            took,
            move.plan.after,
        )
