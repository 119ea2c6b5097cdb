"""The planner process: the live signals in (workers' heartbeats and the gateways' request statistics, over NATS),
one decision every interval (policy.py), role switches out (through the `Actuator`: the cluster's role control),
and what it wants and why on an HTTP endpoint: GET /plan (JSON: the latest decision, the recent ones, the
switches) and GET /metrics (Prometheus: planner_desired_workers{role}, what an autoscaler scales on).

It holds no state the deployment needs: a planner that dies leaves every worker in the role it had (a switch in
flight completes or is refused on the worker's side; docs/planning.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.planner.capacity import TAIL_Q, Costs, Prediction, StepFit, measured_costs, predict
from services.planner.forecast import LengthWindow, Load, RateForecast, percentile
from services.planner.policy import Decision, Policy, PolicyConfig, WorkerState
from shared import bus
from shared.messages import (
    HEARTBEAT_WILDCARD,
    Heartbeat,
    RequestArrived,
    RequestEnded,
    Role,
    decode_or_drop,
    decode_request_stat_or_drop,
    request_stats_subject,
)
from shared.settings import PlannerSettings
from shared.telemetry import metrics

log = logging.getLogger(__name__)

HISTORY = 100  # decisions kept for /plan
MIN_MEASURED = 5  # finished requests an interval needs for its p90s to teach the correction
ARRIVAL_MEMORY_S = 900.0  # an arrival whose end never came is forgotten after this long


class Actuator(Protocol):
    async def switch(self, worker_id: str, role: Role) -> None:
        """Switch the worker's role; returns when it serves the new one, raises when refused or failed."""
        ...


def policy_config(settings: PlannerSettings) -> PolicyConfig:
    return PolicyConfig(
        ttft_slo_s=settings.ttft_slo_ms / 1e3,
        tpot_slo_s=settings.tpot_slo_ms / 1e3,
        margin=settings.margin,
        confirm=settings.confirm_intervals,
        cooldown_s=settings.cooldown_s,
    )


class Signals:
    """What the planner has heard since it started, folded as it arrives (the NATS callbacks) and read once an
    interval (`interval`)."""

    def __init__(self, model: str, worker_ttl_s: float) -> None:
        self.model = model
        self.worker_ttl_s = worker_ttl_s
        self.beats: dict[str, tuple[Heartbeat, float]] = {}  # worker id → (last beat, time.monotonic() heard)
        self.lengths = LengthWindow()
        self.fit = StepFit()
        self._max_tokens: dict[str, tuple[int, float]] = {}  # request id → (max_tokens, arrived at)
        self._arrivals = 0
        self._ttfts: list[float] = []
        self._tpots: list[float] = []

    def heartbeat(self, beat: Heartbeat, now: float) -> None:
        if beat.model == self.model:
            self.beats[beat.worker_id] = (beat, now)

    def arrived(self, stat: RequestArrived) -> None:
        self._arrivals += 1
        self.lengths.arrived(stat.at, stat.prompt_tokens, stat.max_tokens)
        self._max_tokens[stat.request_id] = (stat.max_tokens, stat.at)

    def ended(self, stat: RequestEnded) -> None:
        asked = self._max_tokens.pop(stat.request_id, None)
        if asked is not None and stat.finish_reason in ("stop", "length"):
            self.lengths.ended(stat.output_tokens, asked[0])
        if stat.ttft_s is not None:
            self._ttfts.append(stat.ttft_s)
        if stat.tpot_s is not None:
            self._tpots.append(stat.tpot_s)

    def live(self, now: float) -> list[Heartbeat]:
        for worker, (_, heard) in list(self.beats.items()):
            if now - heard > self.worker_ttl_s:
                del self.beats[worker]
        return [b for b, _ in self.beats.values()]

    def interval(self, seconds: float, wall_now: float) -> tuple[float, list[float], list[float]]:
        """(arrival rate, TTFTs, TPOTs) of the interval that ends now; starts the next one."""
        rate = self._arrivals / seconds
        ttfts, tpots = self._ttfts, self._tpots
        self._arrivals, self._ttfts, self._tpots = 0, [], []
        for rid, (_, at) in list(self._max_tokens.items()):
            if wall_now - at > ARRIVAL_MEMORY_S:
                del self._max_tokens[rid]
        return rate, ttfts, tpots


def worker_states(beats: list[Heartbeat]) -> list[WorkerState]:
    return [WorkerState(b.worker_id, b.role, b.running + b.waiting + b.held_kv, b.draining) for b in beats]


class Planner:
    """One planner: signals → policy → actuator, every interval (see the module)."""

    def __init__(self, settings: PlannerSettings, actuator: Actuator | None) -> None:
        self.settings = settings
        self.model = settings.served_model_name
        self.actuator = actuator if settings.switch_roles else None
        self.signals = Signals(self.model, settings.worker_ttl_s)
        self.policy = Policy(policy_config(settings))
        self.rate = RateForecast()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.switches: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.latest: dict[str, Any] | None = None
        self._switching: asyncio.Task[None] | None = None
        self._ran: Prediction | None = None  # the uncorrected prediction for the split that ran last interval
        self._last_reason = ""

    async def subscribe(self, nc: NATS) -> None:
        await nc.subscribe(HEARTBEAT_WILDCARD, cb=self._on_heartbeat)
        await nc.subscribe(request_stats_subject(self.model), cb=self._on_stat)

    async def _on_heartbeat(self, msg: Msg) -> None:
        beat = decode_or_drop(msg.data, Heartbeat, msg.subject)
        if beat is not None:
            self.signals.heartbeat(beat, time.monotonic())

    async def _on_stat(self, msg: Msg) -> None:
        stat = decode_request_stat_or_drop(msg.data, msg.subject)
        if isinstance(stat, RequestArrived):
            self.signals.arrived(stat)
        elif isinstance(stat, RequestEnded):
            self.signals.ended(stat)

    def tick(self, now: float, wall_now: float) -> Decision:
        """One interval's decision (and the switch it asks for, started in the background)."""
        s = self.signals
        rate, ttfts, tpots = s.interval(self.settings.interval_s, wall_now)
        beats = s.live(now)
        costs = measured_costs(beats, s.fit)
        if self._ran is not None and len(ttfts) >= MIN_MEASURED:
            tpot = percentile(tpots, TAIL_Q) if len(tpots) >= MIN_MEASURED else None
            self.policy.observe_measured(self._ran, percentile(ttfts, TAIL_Q), tpot)
        self.rate.observe(rate)
        load = Load(self.rate.next(), s.lengths.lengths(wall_now))
        switching = self._switching is not None and not self._switching.done()
        decision = self.policy.decide(wall_now, load, costs, worker_states(beats), switching=switching)
        self._ran = self._uncorrected(load, costs, decision)
        self._publish(decision, costs, rate)
        if decision.switch is not None and self.actuator is not None:
            self._switching = asyncio.get_running_loop().create_task(self._switch(decision))
        return decision

    def _uncorrected(self, load: Load, costs: Costs, decision: Decision) -> Prediction | None:
        prefill, decode = decision.current
        return predict(load, costs, prefill, decode) if prefill and decode else None

    def _publish(self, decision: Decision, costs: Costs, observed_rate: float) -> None:
        record = decision.record()
        record["observed_rate"] = round(observed_rate, 3)
        record["costs"] = {
            "prefill_tokens_per_s": round(costs.prefill_tokens_per_s, 1),
            "prefill_step_ms": round(costs.prefill_step_s * 1e3, 2),
            "decode_base_ms": round(costs.decode_base_s * 1e3, 2),
            "decode_per_seq_ms": round(costs.decode_per_seq_s * 1e3, 3),
        }
        correction = self.policy.correction
        record["correction"] = {"ttft": round(correction.ttft, 3), "tpot": round(correction.tpot, 3)}
        self.latest = record
        self.history.append(record)
        for role, n in decision.wanted.items():
            metrics.PLANNER_DESIRED_WORKERS.labels(self.model, role).set(n)
        metrics.PLANNER_FORECAST_RATE.labels(self.model).set(decision.load.rate)
        action = "switch" if decision.switch is not None and self.actuator is not None else "hold"
        metrics.PLANNER_DECISIONS.labels(self.model, action).inc()
        if decision.switch is not None or decision.reason != self._last_reason:
            log.info("planner decision: %s", record)  # each decision that changes something, with its signals
        else:
            log.debug("planner decision: %s", record)
        self._last_reason = decision.reason

    async def _switch(self, decision: Decision) -> None:
        assert decision.switch is not None and self.actuator is not None
        sw = decision.switch
        entry: dict[str, Any] = {"at": decision.at, "worker": sw.worker_id, "from": sw.from_role, "to": sw.to_role}
        started = time.monotonic()
        try:
            await self.actuator.switch(sw.worker_id, sw.to_role)
            entry["result"] = "done"
            log.info("planner: %s switched %s → %s", sw.worker_id, sw.from_role, sw.to_role)
        except Exception as exc:  # refused (last of its role, lock held) or failed: the next interval decides again
            entry["result"] = f"failed: {exc}"
            metrics.PLANNER_DECISIONS.labels(self.model, "failed").inc()
            log.warning("planner: switching %s to %s failed: %s", sw.worker_id, sw.to_role, exc)
        entry["seconds"] = round(time.monotonic() - started, 3)
        self.switches.append(entry)

    def plan(self) -> dict[str, Any]:
        """The /plan document."""
        return {
            "model": self.model,
            "switch_roles": self.actuator is not None,
            "slo": {"ttft_ms": self.settings.ttft_slo_ms, "tpot_ms": self.settings.tpot_slo_ms},
            "latest": self.latest,
            "switches": list(self.switches),
            "history": list(self.history),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every interval until `stop` is set; a switch in flight is waited for (bounded by the actuator)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.interval_s)
            if stop.is_set():
                break
            try:
                self.tick(time.monotonic(), time.time())
            except Exception:  # one bad interval must not end the planner
                log.exception("planner interval failed")
        if self._switching is not None:
            with contextlib.suppress(Exception):
                await self._switching


async def connect(settings: PlannerSettings) -> NATS:
    return await bus.connect(settings, "planner")
