"""Per-request records and their summary, with the definitions and JSON key names of `vllm bench serve`.

Pure arithmetic, no I/O. Definitions (times are client-side, from the request's send):
- TTFT: send → first chunk carrying a token.
- TPOT, per request with more than one output token: (E2EL − TTFT) / (output tokens − 1).
- ITL: every gap between successive token chunks, pooled over all requests.
- E2EL: send → end of the stream.
- goodput: completed requests meeting every SLO given (ttft / tpot / e2el, in ms, each "≤"), per second of run.
  A request with one output token has TPOT 0 for this purpose (as in vLLM).
- prefix cache hit rate: usage.prompt_tokens_details.cached_tokens / prompt tokens, summed over the successful
  requests whose server sent cached_tokens (None when none did).
Statistics use numpy: mean, median, population std, percentiles with linear interpolation; an empty list reports 0.
Failed requests count in `failed` and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds."""

    kind: str
    prompt_len: int
    output_len: int  # requested
    start_s: float  # send time, seconds from the run's start
    success: bool
    error: str = ""
    ttft_s: float = 0.0  # send → first chunk carrying a token
    itl_s: list[float] = field(default_factory=list)  # gaps between successive token chunks
    latency_s: float = 0.0  # send → end of the stream ([DONE])
    output_tokens: int = 0  # from the usage chunk when the server sends one, else the number of token chunks
    # usage.prompt_tokens_details.cached_tokens: prompt tokens the server's prefix cache served; None when not sent
    cached_tokens: int | None = None
    turn: int | None = None  # 1-based turn of a multi-turn conversation; None for a request on its own
    generated_text: str = ""  # the streamed answer (a conversation's next turn sends it back)

    @property
    def tpot_s(self) -> float:
        """(E2EL − TTFT) / (output tokens − 1); 0 for a single output token."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def check_slos(slos: dict[str, float]) -> None:
    """Raise ValueError unless every key is ttft, tpot or e2el and every value a positive number of ms."""
    for key, value in slos.items():
        if key not in SLO_KEYS:
            raise ValueError(f"unknown goodput SLO {key!r}: use {', '.join(SLO_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"goodput SLO {key} must be a positive number of milliseconds, got {value!r}")


def percentile_key(p: float) -> str:
    """The word vLLM puts in pX_ keys: 99 → "99", 99.9 → "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    measured_s = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.latency_s}
    return all(measured_s[key] * 1000.0 <= limit_ms for key, limit_ms in slos.items())


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(most output tokens in any one-second bucket from the first send, most requests in flight at once), over
    successful records, as vLLM reports them (max_output_tokens_per_s, max_concurrent_requests)."""
    if not records:
        return 0.0, 0
    t0 = min(r.start_s for r in records)
    buckets: dict[int, int] = {}
    for r in records:
        t = r.start_s + r.ttft_s
        for gap in [0.0, *r.itl_s]:
            t += gap
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    # Sweep over [start, end) intervals; at equal times an end (-1) sorts before a start (+1).
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.latency_s, -1) for r in records])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return float(max(buckets.values())), peak


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict:
    """The summary dict, keyed as vLLM's result JSON: duration, completed, failed, total_input_tokens,
    total_output_tokens, request_throughput, request_goodput (None without SLOs, as vLLM writes it),
    output_throughput, total_token_throughput, {mean,median,std,pX}_{ttft,tpot,itl,e2el}_ms,
    max_output_tokens_per_s, max_concurrent_requests, total_cached_tokens, prefix_cache_hit_rate; plus per_kind
    {kind: the same over that kind} when the records have more than one kind, and per_turn {"1": the same over
    first turns, ...} when they are conversation turns. Token totals and latencies count successful requests
    only."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    slos = dict(goodput_slos or {})
    check_slos(slos)
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be within [0, 100], got {p}")
    summary = _summary(records, duration_s, slos, percentiles)
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        summary["per_kind"] = {
            kind: _summary([r for r in records if r.kind == kind], duration_s, slos, percentiles) for kind in kinds
        }
    turns = sorted({r.turn for r in records if r.turn is not None})
    if turns:
        summary["per_turn"] = {
            str(turn): _summary([r for r in records if r.turn == turn], duration_s, slos, percentiles) for turn in turns
        }
    return summary


def cache_hits(records: Sequence[RequestRecord]) -> tuple[int, float | None]:
    """(cached prompt tokens, their share of the prompt tokens) over the records whose server reported
    cached_tokens; the share is None when none did (or they had no prompt token)."""
    reported = [r for r in records if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompt = sum(r.prompt_len for r in reported)
    return cached, (cached / prompt if reported and prompt > 0 else None)


def _summary(
    records: list[RequestRecord], duration_s: float, slos: dict[str, float], percentiles: Sequence[float]
) -> dict:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    max_tok_s, max_concurrent = peak_output_rate(ok)
    cached, hit_rate = cache_hits(ok)
    summary: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": sum(_is_good(r, slos) for r in ok) / duration_s if slos else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_concurrent,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": hit_rate,
    }
    per_metric = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s for r in ok],
    }
    for name in LATENCY_METRICS:
        summary |= _stats(name, per_metric[name], percentiles)
    return summary
