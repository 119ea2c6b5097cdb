"""The workload a plan is for: an arrival rate and the distribution of prompt and output lengths, from flags or from
a recorded `pdserve bench` result. The simulation draws its requests from the whole length distribution (so a
long tail of prompts weighs as it does in the record, not as its mean would), with the bench's arrival process
(services/bench/arrivals.py: Gamma intervals, Poisson at burstiness 1). No torch.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.bench.arrivals import arrival_offsets, check_rate
from services.bench.datasets import length_range
from services.planning.simulate import SimRequest

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Workload:
    rate: float  # requests/s
    prompt_lens: tuple[int, ...]  # the distribution's sample: each request draws one (or one pair, when paired)
    output_lens: tuple[int, ...]
    paired: bool = False  # (prompt, output) drawn together: a recorded run's requests
    burstiness: float = 1.0
    source: str = "flags"

    def __post_init__(self) -> None:
        check_rate(self.rate, self.burstiness)
        if math.isinf(self.rate):
            raise ValueError("a plan needs a finite request rate")
        if not self.prompt_lens or not self.output_lens:
            raise ValueError("the workload has no lengths")
        if self.paired and len(self.prompt_lens) != len(self.output_lens):
            raise ValueError("paired lengths must be as many prompts as outputs")
        if min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("prompt and output lengths must be at least 1")

    def with_rate(self, rate: float) -> Workload:
        return Workload(rate, self.prompt_lens, self.output_lens, self.paired, self.burstiness, self.source)

    def requests(self, n: int, seed: int = 0) -> list[SimRequest]:
        """n requests: arrivals of the process at this rate, lengths drawn from the distribution (seeded)."""
        if n < 1:
            raise ValueError(f"need at least one request, got {n}")
        arrivals = arrival_offsets(n, self.rate, self.burstiness, seed)
        rng = random.Random(seed)
        out = []
        for t in arrivals:
            if self.paired:
                i = rng.randrange(len(self.prompt_lens))
                p, o = self.prompt_lens[i], self.output_lens[i]
            else:
                p, o = rng.choice(self.prompt_lens), rng.choice(self.output_lens)
            out.append(SimRequest(t, p, o))
        return out

    def summary(self) -> dict:
        """Rate, burstiness and the lengths' mean and percentiles (what the plan was for)."""
        return {
            "rate": self.rate,
            "burstiness": self.burstiness,
            "source": self.source,
            "isl": _stats(self.prompt_lens),
            "osl": _stats(self.output_lens),
        }


def _stats(values: Sequence[int]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean())} | {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def from_lengths(rate: float, isl: int, osl: int, range_ratio: float = 0.0, burstiness: float = 1.0) -> Workload:
    """`--isl A --osl B`: lengths uniform over the integers of length_range(len, range_ratio), as the bench's
    random dataset draws them (0: every request exactly A in, B out)."""
    lo_i, hi_i = length_range(isl, range_ratio)
    lo_o, hi_o = length_range(osl, range_ratio)
    src = f"--isl {isl} --osl {osl}" + (f" --range-ratio {range_ratio:g}" if range_ratio else "")
    return Workload(rate, tuple(range(lo_i, hi_i + 1)), tuple(range(lo_o, hi_o + 1)), False, burstiness, src)


def from_bench_result(path: str | Path, rate: float | None = None) -> Workload:
    """A `pdserve bench --result-file` JSON. With `--save-detailed`: its successful requests' (prompt, output)
    lengths, and the rate its send times show (n - 1 over first to last send) unless `rate` is given. Without:
    a random dataset's flags (lengths as from_lengths) and the recorded request rate."""
    doc = json.loads(Path(path).read_text())
    burstiness = _number(doc.get("burstiness"), 1.0)
    if "input_lens" in doc and "output_lens" in doc:
        errors = doc.get("errors") or [""] * len(doc["input_lens"])
        pairs = [(i, o) for i, o, e in zip(doc["input_lens"], doc["output_lens"], errors, strict=True) if not e]
        pairs = [(i, o) for i, o in pairs if i >= 1 and o >= 1]
        if not pairs:
            raise ValueError(f"{path}: no successful request to take lengths from")
        if rate is None:
            rate = _sent_rate(doc.get("start_times") or [], doc)
        prompts, outputs = zip(*pairs, strict=True)
        return Workload(rate, tuple(prompts), tuple(outputs), True, burstiness, f"{path} ({len(pairs)} requests)")
    workload = doc.get("workload") or {}
    if doc.get("dataset_name") == "random" and "random_input_len" in workload:
        rate = rate if rate is not None else _recorded_rate(doc)
        return from_lengths(
            rate, int(workload["random_input_len"]), int(workload["random_output_len"]),
            float(workload.get("random_range_ratio") or 0.0), burstiness,
        )  # fmt: skip
    raise ValueError(f"{path}: no per-request lengths (run `pdserve bench` with --save-detailed) and not a random "
                     "dataset's flags")  # fmt: skip


def _number(value, default: float) -> float:
    if value in (None, "inf"):
        return default if value is None else math.inf
    return float(value)


def _recorded_rate(doc: dict) -> float:
    rate = _number(doc.get("request_rate"), math.inf)
    if math.isinf(rate):
        raise ValueError("the recorded run sent everything at once (request_rate inf): give --rate")
    return rate


def _sent_rate(starts: Sequence[float], doc: dict) -> float:
    if len(starts) >= 2 and max(starts) > min(starts):
        return (len(starts) - 1) / (max(starts) - min(starts))
    return _recorded_rate(doc)
