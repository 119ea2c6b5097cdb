"""Request arrival processes: when each benchmark request is sent, in seconds from the run's start.

Intervals between arrivals are Gamma(shape=burstiness, scale=1/(rate·burstiness)), as in `vllm bench serve`:
mean 1/rate whatever the burstiness, coefficient of variation 1/√burstiness. burstiness = 1 is a Poisson process
(exponential intervals); below 1 arrivals come in bursts, above 1 they are more even, and inf spaces them exactly
1/rate apart. A rate of inf sends everything at t = 0.

Unlike vLLM, the cumulative times are not rescaled so that the last one lands at n/rate: the process stays a true
renewal process (what `interference_requests` needs to cut it at a duration), and runs with the same seed still get
the same schedule.
"""

from __future__ import annotations

import math

import numpy as np


def check_rate(rate: float, burstiness: float) -> None:
    """Raise ValueError unless rate > 0 (inf allowed) and burstiness > 0 (inf allowed)."""
    if not rate > 0:  # also catches nan
        raise ValueError(f"request rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive (or inf), got {burstiness}")


def gamma_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n intervals (seconds, float64) between successive arrivals; zeros when rate is inf."""
    check_rate(rate, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of n requests: the cumulative sum of n intervals, so the first one also waits one interval
    (as vLLM's does). Non-decreasing; deterministic for a given seed."""
    rng = np.random.default_rng(seed)
    return np.cumsum(gamma_intervals(n, rate, burstiness, rng)).tolist()


def arrivals_until(duration_s: float, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Every arrival time of the process in [0, duration_s), ascending; rate must be finite."""
    if math.isinf(rate):
        raise ValueError("a duration-bounded arrival process needs a finite rate")
    times: list[float] = []
    t = 0.0
    # Draw in batches sized to the expected count so a long duration costs a few numpy calls, not one per arrival.
    batch = max(16, int(duration_s * rate * 1.1) + 16)
    while True:
        for gap in gamma_intervals(batch, rate, burstiness, rng):
            t += float(gap)
            if t >= duration_s:
                return times
            times.append(t)
