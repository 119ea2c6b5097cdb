"""The planner's decision, pure: given one interval's signals it says which worker (if any) to switch to which role
and how many workers of each role it wants, and why. The service (service.py) feeds it live signals; the unit tests
replay recorded ones.

The rule, each interval:

1. the best split of the switchable workers (the live prefill and decode workers, not draining; mixed workers serve
   both and are left alone) is the one whose worse SLO ratio (capacity.Prediction.score) is lowest under the
   forecast load; ties keep the current split;
2. it is acted on only if it is clearly better (`margin`: its score below the current one's by that share, or the
   current split misses an SLO the best one meets), pointed the same way for `confirm` intervals in a row
   (hysteresis: one noisy interval moves nothing), no switch in the last `cooldown_s`, none in progress, and the
   load is more than noise (`min_rate`);
3. one worker moves per decision, the least loaded of the role that gives one up, never the last of its role;
4. the wanted counts per role (for an autoscaler) are the fewest workers of each role that meet its SLO with
   `headroom` to spare, at least one each, independent of how many run now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.planner.capacity import Correction, Costs, Prediction, predict, splits
from services.planner.forecast import Load
from shared.messages import Role

MAX_WANTED = 64  # the most workers of a role the planner ever asks for


@dataclass(frozen=True)
class PolicyConfig:
    ttft_slo_s: float = 2.5
    tpot_slo_s: float = 0.1
    margin: float = 0.2
    confirm: int = 2
    cooldown_s: float = 30.0
    min_rate: float = 0.05  # requests/s below which the load is noise: nothing moves
    headroom: float = 0.8  # the wanted counts keep each predicted SLO ratio at or below this

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("the SLOs must be positive")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.confirm < 1:
            raise ValueError(f"confirm must be at least 1, got {self.confirm}")
        if self.cooldown_s < 0 or self.min_rate < 0:
            raise ValueError("cooldown_s and min_rate must not be negative")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom}")


@dataclass(frozen=True)
class WorkerState:
    """One live worker as the planner sees it (from its heartbeat)."""

    worker_id: str
    role: Role
    load: int = 0  # running + waiting requests (+ held KV on a prefill worker): the cheaper to switch, the lower
    draining: bool = False


@dataclass(frozen=True)
class Switch:
    worker_id: str
    from_role: Role
    to_role: Role


@dataclass(frozen=True)
class Decision:
    at: float
    switch: Switch | None
    reason: str
    current: tuple[int, int]  # (prefill, decode) switchable workers now
    best: tuple[int, int]
    wanted: dict[str, int]  # role → workers wanted (the autoscaler's target)
    load: Load
    predictions: dict[str, dict[str, float | int]] = field(default_factory=dict)  # "current", "best"

    def record(self) -> dict[str, Any]:
        """The decision with the signals that caused it: what the planner logs and serves."""
        return {
            "at": self.at,
            "action": "switch" if self.switch else "hold",
            "switch": None
            if self.switch is None
            else {"worker": self.switch.worker_id, "from": self.switch.from_role, "to": self.switch.to_role},
            "reason": self.reason,
            "current": {"prefill": self.current[0], "decode": self.current[1]},
            "best": {"prefill": self.best[0], "decode": self.best[1]},
            "wanted": self.wanted,
            "forecast": self.load.summary(),
            "predictions": self.predictions,
        }


class Policy:
    """The decision's memory between intervals: the streak of the best split's direction and the last switch."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.correction = Correction()
        self._streak_direction = 0  # +1: towards more prefill; -1: more decode
        self._streak = 0
        self._last_switch_at = -math.inf

    def observe_measured(self, at_split: Prediction, ttft_p90_s: float | None, tpot_p90_s: float | None) -> None:
        """What was measured while `at_split` (uncorrected) ran: the correction learns from it."""
        self.correction.observe(at_split, ttft_p90_s, tpot_p90_s)

    def predict(self, load: Load, costs: Costs, prefill: int, decode: int) -> Prediction:
        return self.correction.apply(predict(load, costs, prefill, decode))

    def wanted(self, load: Load, costs: Costs) -> dict[str, int]:
        c, head = self.config, self.config.headroom
        p = next(
            (n for n in range(1, MAX_WANTED + 1) if self.predict(load, costs, n, 1).ttft_s <= head * c.ttft_slo_s),
            MAX_WANTED,
        )
        d = next(
            (n for n in range(1, MAX_WANTED + 1) if self.predict(load, costs, 1, n).tpot_s <= head * c.tpot_slo_s),
            MAX_WANTED,
        )
        return {Role.PREFILL.value: p, Role.DECODE.value: d}

    def decide(
        self, now: float, load: Load, costs: Costs, workers: list[WorkerState], switching: bool = False
    ) -> Decision:
        c = self.config
        live = [w for w in workers if not w.draining and w.role in (Role.PREFILL, Role.DECODE)]
        prefill = sum(w.role is Role.PREFILL for w in live)
        decode = len(live) - prefill
        current = (prefill, decode)
        wanted = self.wanted(load, costs)

        def hold(reason: str, best: tuple[int, int] = current, predictions: dict | None = None) -> Decision:
            return Decision(now, None, reason, current, best, wanted, load, predictions or {})

        if prefill < 1 or decode < 1:
            self._reset()
            return hold("a role has no worker: nothing to switch between (the planner never empties one)")
        scored = {s: self.predict(load, costs, *s) for s in splits(len(live))}
        now_pred = scored[current]
        best = min(scored, key=lambda s: (scored[s].score(c.ttft_slo_s, c.tpot_slo_s), s != current))
        best_pred = scored[best]
        predictions = {"current": now_pred.summary(), "best": best_pred.summary()}
        if load.rate < c.min_rate:
            self._reset()
            return hold(f"load {load.rate:.3f} req/s is below min_rate", best, predictions)
        if best == current:
            self._reset()
            return hold("the current split is the best", best, predictions)
        now_score = now_pred.score(c.ttft_slo_s, c.tpot_slo_s)
        best_score = best_pred.score(c.ttft_slo_s, c.tpot_slo_s)
        rescues = now_score > 1 >= best_score
        if not rescues and not best_score <= (1 - c.margin) * now_score:
            self._reset()
            why = f"best split {best} scores {best_score:.2f} against {now_score:.2f}: within the margin"
            return hold(why, best, predictions)
        direction = 1 if best[0] > prefill else -1
        self._streak = self._streak + 1 if direction == self._streak_direction else 1
        self._streak_direction = direction
        if self._streak < c.confirm:
            return hold(f"best split {best} seen {self._streak} of {c.confirm} intervals in a row", best, predictions)
        if switching:
            return hold("a switch is in progress", best, predictions)
        if now - self._last_switch_at < c.cooldown_s:
            return hold(f"cooling down: last switch {now - self._last_switch_at:.0f} s ago", best, predictions)
        donor, taker = (Role.DECODE, Role.PREFILL) if direction > 0 else (Role.PREFILL, Role.DECODE)
        worker = min((w for w in live if w.role is donor), key=lambda w: (w.load, w.worker_id))
        self._last_switch_at = now
        self._reset()
        why = (
            f"{donor.value} → {taker.value}: split {current} scores {now_score:.2f} (ttft p90 "
            f"{now_pred.ttft_s * 1e3:.0f} ms, tpot {now_pred.tpot_s * 1e3:.0f} ms), {best} scores {best_score:.2f}"
        )
        return Decision(now, Switch(worker.worker_id, donor, taker), why, current, best, wanted, load, predictions)

    def _reset(self) -> None:
        self._streak, self._streak_direction = 0, 0
