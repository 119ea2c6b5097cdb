"""The next interval's load: request rate (Holt's linear smoothing, so a ramp is followed, not lagged) and the
prompt and output length distributions of the recent requests (percentiles, not only means).

An output length is known only when a request ends, a decode life after it arrived; the phase of a workload can
change faster than that. So each arrival counts with its max_tokens times the fill ratio (output / max_tokens,
averaged over the requests that ended lately; 1 until one has): a client that asks for 300 tokens and gets them
counts as 300 at its arrival."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

RATE_ALPHA = 0.5  # level: about the last two intervals
RATE_BETA = 0.3  # trend
FILL_ALPHA = 0.1  # the fill ratio: about the last ten requests that ended
# the lengths' window: short enough that a phase change shows within a few intervals (a 60 s window held a phase's
# long prompts for a minute after it ended: benchmarks/planner_phases.py), yet never fewer than MIN_SAMPLES arrivals
LENGTH_WINDOW_S = 20.0
MIN_SAMPLES = 16


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, linearly interpolated; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Lengths:
    """Prompt and (expected) output lengths of the recent requests, in tokens."""

    prompts: tuple[int, ...] = ()
    outputs: tuple[float, ...] = ()

    def prompt(self, q: float) -> float:
        return percentile(self.prompts, q)

    def output(self, q: float) -> float:
        return percentile(self.outputs, q)

    @property
    def prompt_mean(self) -> float:
        return sum(self.prompts) / len(self.prompts) if self.prompts else 0.0

    @property
    def output_mean(self) -> float:
        return sum(self.outputs) / len(self.outputs) if self.outputs else 0.0


@dataclass(frozen=True)
class Load:
    """The forecast of the next interval."""

    rate: float  # requests/s
    lengths: Lengths

    def summary(self) -> dict[str, float]:
        return {
            "rate": round(self.rate, 3),
            "prompt_p50": self.lengths.prompt(0.5),
            "prompt_p90": self.lengths.prompt(0.9),
            "output_p50": round(self.lengths.output(0.5), 1),
            "output_p90": round(self.lengths.output(0.9), 1),
            "samples": len(self.lengths.prompts),
        }


class RateForecast:
    """Holt's linear exponential smoothing of the per-interval arrival rate: level + trend, never below 0."""

    def __init__(self, alpha: float = RATE_ALPHA, beta: float = RATE_BETA) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def observe(self, rate: float) -> None:
        if self.level is None:
            self.level = rate
            return
        previous = self.level
        self.level = self.alpha * rate + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def next(self) -> float:
        return 0.0 if self.level is None else max(self.level + self.trend, 0.0)


class LengthWindow:
    """The recent arrivals' prompt lengths and expected output lengths (see the module): those of the last window_s,
    or the last min_samples arrivals when fewer came in that window."""

    def __init__(
        self, window_s: float = LENGTH_WINDOW_S, fill_alpha: float = FILL_ALPHA, min_samples: int = MIN_SAMPLES
    ) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self.fill_alpha = fill_alpha
        self.fill = 1.0  # output / max_tokens of the requests that ended lately
        self._seen_fill = False
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (at, prompt tokens, max_tokens), oldest first

    def arrived(self, at: float, prompt_tokens: int, max_tokens: int) -> None:
        self._arrivals.append((at, prompt_tokens, max_tokens))

    def ended(self, output_tokens: int, max_tokens: int) -> None:
        if max_tokens <= 0:
            return
        ratio = min(output_tokens / max_tokens, 1.0)
        self.fill = ratio if not self._seen_fill else self.fill_alpha * ratio + (1 - self.fill_alpha) * self.fill
        self._seen_fill = True

    def lengths(self, now: float) -> Lengths:
        while len(self._arrivals) > self.min_samples and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        prompts = tuple(p for _, p, _ in self._arrivals)
        outputs = tuple(max(m * self.fill, 1.0) for _, _, m in self._arrivals)
        return Lengths(prompts, outputs)
