"""What a split of the workers into prefill and decode would serve, from what the workers measured: the planner's
model of the deployment (docs/planning.md, "The SLO planner's model").

Prefill: each of P workers takes 1/P of the arrivals, one prompt at a time, a prompt of n tokens costing
`step + n / rate` (the prefill worker's measured coefficients). That is an M/G/1 queue per worker: its mean wait is
Pollaczek-Khinchine's λ E[S²] / 2(1 - ρ), and its wait's tail is taken as exponential with that mean beyond the
chance ρ of waiting at all, so the p90 wait is (Wq / ρ) ln(ρ / 0.1). TTFT p90 = that wait + the service of a p90
prompt.

Decode: by Little's law the requests decoding at once are λ × output tokens × TPOT; a worker's step grows with its
batch b as a + c·b (fitted from the decode workers' heartbeats: their step at the batch they ran), and its TPOT is
its step. With D workers, b = λ·L·(a + c·b) / D, so b = λ·L·a / (D − λ·L·c) (no b when D ≤ λ·L·c: the workers cannot
keep up), and TPOT = a + c·b.

Both predictions are multiplied by a correction learnt from the measured p90s against the predicted ones at the
split that was running (`Correction`), so the model's bias on this deployment is taken out, as the gateway's
PlaneTime does for the prefill path.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean

from services.planner.forecast import Load
from shared.cost_defaults import (
    DEFAULT_DECODE_STEP_GROWTH,
    DEFAULT_DECODE_STEP_MS,
    DEFAULT_PREFILL_STEP_MS,
    DEFAULT_PREFILL_TOKENS_PER_S,
)
from shared.messages import Heartbeat, Role

TAIL_Q = 0.9  # the planner keeps the p90s under the SLOs
# (batch, step) points the decode step's line is fitted to, newest kept: a few intervals' worth, so a decode worker
# whose step grows under a new load shows in the line within them (64 points held the idle phase's small batches
# half a minute into a decode-heavy one: benchmarks/planner_phases.py)
STEP_FIT_POINTS = 16
CORRECTION_ALPHA = 0.2
CORRECTION_BOUNDS = (0.5, 4.0)  # a model off by more than this is not corrected but noticed (the decision logs it)


@dataclass(frozen=True)
class Costs:
    """The deployment's cost coefficients, in seconds."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    prefill_step_s: float = DEFAULT_PREFILL_STEP_MS / 1e3
    decode_base_s: float = DEFAULT_DECODE_STEP_MS / 1e3  # a: the step of an empty batch
    decode_per_seq_s: float = DEFAULT_DECODE_STEP_MS / 1e3 * DEFAULT_DECODE_STEP_GROWTH  # c: each sequence more

    def prefill_s(self, prompt_tokens: float) -> float:
        return self.prefill_step_s + prompt_tokens / self.prefill_tokens_per_s

    def decode_step_s(self, batch: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch


class StepFit:
    """The decode step's line a + c·b through the (batch, step) points the decode workers' heartbeats report, least
    squares, with c ≥ 0; until two batch sizes were seen, the one-sequence default growth around what was seen."""

    def __init__(self, points: int = STEP_FIT_POINTS) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=points)

    def observe(self, batch: int, step_s: float) -> None:
        if batch > 0 and step_s > 0:
            self._points.append((float(batch), step_s))

    def line(self) -> tuple[float, float] | None:
        """(a, c), or None before any point."""
        if not self._points:
            return None
        xs, ys = [p[0] for p in self._points], [p[1] for p in self._points]
        mx, my = fmean(xs), fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx < 1e-9:  # one batch size: the default growth through that point
            c = my / (1 + DEFAULT_DECODE_STEP_GROWTH * mx) * DEFAULT_DECODE_STEP_GROWTH
        else:
            c = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx, 0.0)
        a = max(my - c * mx, my * 0.05)  # a step costs something even empty
        return a, c


def measured_costs(beats: Iterable[Heartbeat], fit: StepFit) -> Costs:
    """The coefficients the live workers measured (their means), the defaults where none has; feeds `fit` with the
    decode workers' (batch, step) points."""
    beats = list(beats)
    rates, steps = [], []
    for b in beats:
        c = b.path_calibration
        if c is None:
            continue
        if b.role is Role.PREFILL and c.prefill_tokens_per_s:
            rates.append(c.prefill_tokens_per_s)
        if b.role is Role.PREFILL and c.prefill_step_ms:
            steps.append(c.prefill_step_ms / 1e3)
        if b.role is Role.DECODE and c.decode_step_ms:
            fit.observe(b.running, c.decode_step_ms / 1e3)
    line = fit.line()
    defaults = Costs()
    return Costs(
        prefill_tokens_per_s=fmean(rates) if rates else defaults.prefill_tokens_per_s,
        prefill_step_s=fmean(steps) if steps else defaults.prefill_step_s,
        decode_base_s=line[0] if line else defaults.decode_base_s,
        decode_per_seq_s=line[1] if line else defaults.decode_per_seq_s,
    )


@dataclass(frozen=True)
class Prediction:
    """What a split would serve under the forecast load: p90 TTFT and the TPOT, in seconds (inf: it cannot keep
    up), and the utilisations behind them."""

    prefill_workers: int
    decode_workers: int
    ttft_s: float
    tpot_s: float
    prefill_utilisation: float
    decode_batch: float

    def score(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """The worse of the two against its SLO (1 = at the SLO): the split with the lowest serves best."""
        return max(self.ttft_s / ttft_slo_s, self.tpot_s / tpot_slo_s)

    def summary(self) -> dict[str, float | int]:
        def ms(s: float) -> float:
            return round(s * 1e3, 1) if math.isfinite(s) else -1.0

        return {
            "prefill": self.prefill_workers,
            "decode": self.decode_workers,
            "ttft_p90_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "prefill_utilisation": round(self.prefill_utilisation, 3),
            "decode_batch": round(self.decode_batch, 2),
        }


def predict_prefill(load: Load, costs: Costs, workers: int) -> tuple[float, float]:
    """(TTFT p90, utilisation) of `workers` prefill workers (see the module)."""
    if load.rate <= 0 or not load.lengths.prompts:
        return costs.prefill_s(load.lengths.prompt(TAIL_Q)), 0.0
    services = [costs.prefill_s(n) for n in load.lengths.prompts]
    es, es2 = fmean(services), fmean(s * s for s in services)
    lam = load.rate / workers
    rho = lam * es
    if rho >= 1.0:
        return math.inf, rho
    wq = lam * es2 / (2 * (1 - rho))
    wait = (wq / rho) * math.log(rho / (1 - TAIL_Q)) if rho > 1 - TAIL_Q else 0.0
    return wait + costs.prefill_s(load.lengths.prompt(TAIL_Q)), rho


def predict_decode(load: Load, costs: Costs, workers: int) -> tuple[float, float]:
    """(TPOT, batch per worker) of `workers` decode workers (see the module)."""
    demand = load.rate * load.lengths.output_mean  # output tokens per second, all workers
    a, c = costs.decode_base_s, costs.decode_per_seq_s
    if demand <= 0:
        return costs.decode_step_s(1), 0.0
    if workers <= demand * c:
        return math.inf, math.inf
    batch = demand * a / (workers - demand * c)
    return costs.decode_step_s(max(batch, 1.0)), batch


def predict(load: Load, costs: Costs, prefill_workers: int, decode_workers: int) -> Prediction:
    ttft, rho = predict_prefill(load, costs, prefill_workers)
    tpot, batch = predict_decode(load, costs, decode_workers)
    return Prediction(prefill_workers, decode_workers, ttft, tpot, rho, batch)


class Correction:
    """Measured over predicted, per SLO, exponentially weighted and bounded (see the module): multiplies every
    prediction. Learnt only from intervals with enough finished requests to have a p90."""

    def __init__(self, alpha: float = CORRECTION_ALPHA) -> None:
        self.alpha = alpha
        self.ttft = 1.0
        self.tpot = 1.0

    def observe(self, predicted: Prediction, measured_ttft_s: float | None, measured_tpot_s: float | None) -> None:
        self.ttft = self._blend(self.ttft, predicted.ttft_s, measured_ttft_s)
        self.tpot = self._blend(self.tpot, predicted.tpot_s, measured_tpot_s)

    def _blend(self, current: float, predicted: float, measured: float | None) -> float:
        if measured is None or not math.isfinite(predicted) or predicted <= 0:
            return current
        lo, hi = CORRECTION_BOUNDS
        ratio = min(max(measured / predicted, lo), hi)
        return self.alpha * ratio + (1 - self.alpha) * current

    def apply(self, p: Prediction) -> Prediction:
        return Prediction(
            p.prefill_workers,
            p.decode_workers,
            p.ttft_s * self.ttft,
            p.tpot_s * self.tpot,
            p.prefill_utilisation,
            p.decode_batch,
        )


def splits(total: int) -> Sequence[tuple[int, int]]:
    """Every split of `total` workers that keeps at least one of each role."""
    return [(p, total - p) for p in range(1, total)]
