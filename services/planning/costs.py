"""A worker configuration's step costs, from what its profile measured (profile_file.ConfigProfile). No torch.

Prefill. The profile times prompts of several lengths alone, T(L) seconds over steps(L) engine steps. A step costs
an overhead `step_s` (the forward's fixed part: Python, the LM head, sampling) plus the work of its prompt tokens.
`step_s` is the intercept of a least-squares line through the prompts that ran in one step, clamped to
[0, the shortest one's time]; the work of a prompt's first L tokens is W(L) = T(L) - step_s x steps(L),
piecewise linear through (0, 0) and the measured lengths (made non-decreasing), extended past the longest by its
last segment's slope. A chunk of tokens [a, b) of a prompt costs W(b) - W(a): chunks later in a long prompt cost
what the measured long prompts' later tokens did (attention over more context included), and a prompt alone
costs exactly what was measured.

Decode. The profile times decode-only steps of B sequences at mean context C. Per measured batch size the step is
a line in C (fitted where that B was measured at two or more contexts; else through its one point with the
per-sequence context slope the other batch sizes show); between measured batch sizes it is interpolated linearly
in B, and past the largest extrapolated with the last two sizes' slope (never below the largest's time).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from services.planning.profile_file import ConfigProfile, DecodePoint, PrefillPoint


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); a single point or one x: through the origin's slope, intercept 0."""
    if len(xs) < 2 or max(xs) == min(xs):
        x, y = sum(xs), sum(ys)
        return 0.0, (y / x if x else 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


@dataclass(frozen=True)
class PrefillCost:
    step_s: float  # a step's overhead before its prompt tokens
    lengths: tuple[int, ...]  # 0 then the measured prompt lengths, ascending
    work: tuple[float, ...]  # W at each length (non-decreasing)

    @classmethod
    def fit(cls, points: Sequence[PrefillPoint], budget: int) -> PrefillCost:
        pts = sorted(points, key=lambda p: p.tokens)
        single = [p for p in pts if p.steps <= 1 and p.tokens <= budget] or pts[:1]
        intercept, _ = line([p.tokens for p in single], [p.seconds for p in single])
        step_s = min(max(intercept, 0.0), min(p.seconds for p in single))
        lengths, work = [0], [0.0]
        for p in pts:
            if p.tokens <= lengths[-1]:
                continue
            lengths.append(p.tokens)
            work.append(max(work[-1], p.seconds - step_s * max(p.steps, 1)))
        if len(lengths) < 2:
            raise ValueError("a prefill cost needs at least one prompt of one token or more")
        return cls(step_s, tuple(lengths), tuple(work))

    def tokens_work(self, end: float) -> float:
        """W(end): the work of a prompt's first `end` tokens, seconds."""
        ls, ws = self.lengths, self.work
        if end >= ls[-1]:  # past the longest: its last segment's slope (fit() keeps two lengths at least)
            slope = (ws[-1] - ws[-2]) / (ls[-1] - ls[-2])
            return ws[-1] + slope * (end - ls[-1])
        i = bisect.bisect_right(ls, end)
        lo, hi = i - 1, i
        frac = (end - ls[lo]) / (ls[hi] - ls[lo])
        return ws[lo] + frac * (ws[hi] - ws[lo])

    def chunk_s(self, start: int, end: int) -> float:
        """The work of tokens [start, end) of one prompt."""
        return self.tokens_work(end) - self.tokens_work(start)

    def alone_s(self, tokens: int, budget: int) -> float:
        """A prompt alone on an idle worker: its steps' overheads and its work."""
        steps = max(1, -(-tokens // budget))
        return steps * self.step_s + self.tokens_work(tokens)


@dataclass(frozen=True)
class DecodeCost:
    batches: tuple[int, ...]  # measured batch sizes, ascending
    intercepts: tuple[float, ...]  # per batch size: step = intercept + slope x context
    slopes: tuple[float, ...]

    @classmethod
    def fit(cls, points: Sequence[DecodePoint]) -> DecodeCost:
        by_batch: dict[int, list[DecodePoint]] = {}
        for p in points:
            by_batch.setdefault(p.batch, []).append(p)
        # per-sequence context slope where a batch size was measured at several contexts (shared with the others)
        per_seq = []
        lines: dict[int, tuple[float, float]] = {}
        for b, ps in by_batch.items():
            if len({p.context for p in ps}) >= 2:
                a, s = line([p.context for p in ps], [p.step_s for p in ps])
                lines[b] = (a, max(s, 0.0))
                per_seq.append(max(s, 0.0) / b)
        gamma = statistics.median(per_seq) if per_seq else 0.0
        batches = sorted(by_batch)
        intercepts, slopes = [], []
        for b in batches:
            if b in lines:
                a, s = lines[b]
            else:
                s = gamma * b
                a = statistics.fmean(p.step_s - s * p.context for p in by_batch[b])
            intercepts.append(a)
            slopes.append(s)
        return cls(tuple(batches), tuple(intercepts), tuple(slopes))

    def _at(self, i: int, context: float) -> float:
        return max(self.intercepts[i] + self.slopes[i] * context, 0.0)

    def step_s(self, batch: int, context: float) -> float:
        """One decode-only step of `batch` sequences at mean context `context`."""
        bs = self.batches
        if batch <= bs[0] or len(bs) == 1:
            base = self._at(0, context)
            if batch > bs[0]:  # one measured size only: grow in proportion to the batch past it
                return base * batch / bs[0]
            return base
        if batch >= bs[-1]:
            hi, lo = self._at(len(bs) - 1, context), self._at(len(bs) - 2, context)
            slope = max((hi - lo) / (bs[-1] - bs[-2]), 0.0)
            return hi + slope * (batch - bs[-1])
        i = bisect.bisect_right(bs, batch)
        frac = (batch - bs[i - 1]) / (bs[i] - bs[i - 1])
        return self._at(i - 1, context) + frac * (self._at(i, context) - self._at(i - 1, context))


@dataclass(frozen=True)
class WorkerCosts:
    """What one worker of a configuration costs per step."""

    name: str
    units: int
    prefill: PrefillCost
    decode: DecodeCost
    kv_tokens: int

    @classmethod
    def of(cls, profile: ConfigProfile, budget: int) -> WorkerCosts:
        return cls(
            profile.config.name,
            profile.config.units,
            PrefillCost.fit(profile.prefill, budget),
            DecodeCost.fit(profile.decode),
            profile.kv_tokens,
        )


@dataclass(frozen=True)
class WorkerOverhead:
    """A worker's time outside the engine in a step that gives `n` outputs (PlaneCosts.worker): linear between the
    measured points (made non-decreasing), flat below the first, past the last with its last segment's slope."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, points: Sequence[tuple[float, float]]) -> WorkerOverhead:
        out: list[tuple[float, float]] = []
        for n, s in sorted(points):
            if not out or n > out[-1][0]:
                out.append((n, max(s, out[-1][1] if out else 0.0, 0.0)))
        return cls(tuple(out))

    def at(self, n: float) -> float:
        ps = self.points
        if not ps:
            return 0.0
        if n <= ps[0][0]:
            return ps[0][1]
        if n >= ps[-1][0]:
            if len(ps) == 1:
                return ps[0][1]
            (n0, s0), (n1, s1) = ps[-2], ps[-1]
            return s1 + (s1 - s0) / (n1 - n0) * (n - n1)
        i = bisect.bisect_right([p[0] for p in ps], n)
        (n0, s0), (n1, s1) = ps[i - 1], ps[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
