"""Decode routed by expert affinity: the summaries and the choice, torch-free (the gateway, the prefill worker and
the decode worker's heartbeat use them).

A request's prefill activates some experts more than others; a decode worker's recent load favours some too. With
the gateway's `expert_affinity_routing` on, the prefill worker summarises which (sparse layer, logical expert) pairs
the prompt's tokens were routed to (`summarise`: the top k by tokens), and hands the decode job to the candidate
decode worker whose own recent summary (its heartbeat's, `HotExpertsWindow`) overlaps it most (`choose`). The
overlap is the histogram intersection of the two summaries' token shares: Σ over the pairs both name of the smaller
share, in [0, 1] (1: the same pairs in the same proportions). No overlap with any candidate: no preference (the
shared queue).

Whether it pays is a benchmark question (benchmarks/affinity_bench.py): a decode worker that serves requests with
similar experts concentrates its load on fewer experts, which an expert-parallel group's live placement (--eplb)
can then spread, and which an expert cache or offload would keep resident. Routing never changes tokens: every
decode worker computes the same greedy output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.messages import AffinityCandidate, HotExperts

REQUEST_TOP_K = 8  # a request's summary: its 8 heaviest (layer, expert) pairs (the gateway's default)
WORKER_TOP_K = 32  # a decode worker's: more, since it sums many requests
# affinity never sends a job to a decode worker running this many more requests than the least busy candidate: a
# pure overlap score feeds itself (a worker that served more matches more) and piled 2/3 of the requests on one of two
# workers in benchmarks/affinity_bench.py
RUNNING_SLACK = 4
WORKER_DECAY = 0.8  # each heartbeat (1 s) a decode worker's older load counts 0.8: a half-life of 3 s


def summarise(load: Mapping[int, Sequence[float]], top_k: int) -> HotExperts | None:
    """Layer → tokens per logical expert → the top_k (layer, expert) pairs by tokens, heaviest first (ties: lower
    layer, then lower expert); None when nothing was routed."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    pairs = [(-t, layer, e) for layer, counts in load.items() for e, t in enumerate(counts) if t > 0]
    if not pairs:
        return None
    top = sorted(pairs)[:top_k]
    return HotExperts([layer for _, layer, _ in top], [e for _, _, e in top], [round(-t) for t, _, _ in top])


def overlap(a: HotExperts, b: HotExperts) -> float:
    """The histogram intersection of two summaries' token shares, in [0, 1]."""
    sa, sb = _shares(a), _shares(b)
    return sum(min(share, sb[pair]) for pair, share in sa.items() if pair in sb)


def _shares(hot: HotExperts) -> dict[tuple[int, int], float]:
    total = sum(hot.tokens)
    if total == 0:
        return {}
    return {(layer, e): t / total for layer, e, t in zip(hot.layers, hot.experts, hot.tokens, strict=True)}


def choose(
    request: HotExperts | None, candidates: Sequence[AffinityCandidate], slack: int = RUNNING_SLACK
) -> str | None:
    """Among the candidates running at most `slack` more requests than the least busy one, the one whose hot experts
    overlap the request's most (ties: the fewest running, then the gateway's order); None when the request has no
    summary or overlaps none of them (the shared queue)."""
    if request is None or not candidates:
        return None
    least = min(c.running for c in candidates)
    best: tuple[float, int, int] | None = None
    chosen = None
    for i, c in enumerate(candidates):
        if c.running > least + slack:
            continue
        score = overlap(request, c.hot)
        if score <= 0.0:
            continue
        key = (-score, c.running, i)
        if best is None or key < best:
            best, chosen = key, c.worker_id
    return chosen


class HotExpertsWindow:
    """A decode worker's recent expert load: each heartbeat's counts (layer → tokens per expert) added to the older
    ones halved (`WORKER_DECAY`), summarised as its `WORKER_TOP_K` heaviest pairs for the heartbeat."""

    def __init__(self, top_k: int = WORKER_TOP_K, decay: float = WORKER_DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.top_k, self.decay = top_k, decay
        self._load: dict[int, list[float]] = {}
        self.hot: HotExperts | None = None  # the latest summary

    def add(self, load: Mapping[int, Sequence[int]]) -> HotExperts | None:
        """Fold one interval's counts in; → the summary now."""
        for layer, counts in load.items():
            old = self._load.get(layer, [0.0] * len(counts))
            self._load[layer] = [o * self.decay + c for o, c in zip(old, counts, strict=True)]
        for layer in set(self._load) - set(load):
            self._load[layer] = [o * self.decay for o in self._load[layer]]
        # below one token (decayed away): dropped from the summary, so an idle worker's shows nothing
        self.hot = summarise({k: [t if t >= 1.0 else 0.0 for t in v] for k, v in self._load.items()}, self.top_k)
        return self.hot
