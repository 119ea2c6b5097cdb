"""The result table `pdserve bench` prints, laid out as `vllm bench serve` prints its own (text only, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from services.bench.metrics import LATENCY_METRICS, percentile_key

WIDTH = 50
HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}".rstrip()
    return f"{label:<40} {value!s:<10}".rstrip()


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}"


def format_table(summary: dict, percentiles: Sequence[float], metrics: Sequence[str] = LATENCY_METRICS) -> str:
    """The vLLM-style block for one summary (as BenchResult.summary), then one line per workload kind when the
    summary has per_kind. `metrics` picks which latency sections to show."""
    lines = [_rule(" Serving Benchmark Result ", "=")]
    lines.append(_row("Successful requests:", summary["completed"]))
    lines.append(_row("Failed requests:", summary["failed"]))
    if summary.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", summary["max_concurrency"]))
    if isinstance(summary.get("request_rate"), int | float):
        lines.append(_row("Request rate configured (RPS):", float(summary["request_rate"])))
    lines.append(_row("Benchmark duration (s):", float(summary["duration"])))
    lines.append(_row("Total input tokens:", summary["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", summary["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", summary["request_throughput"]))
    if summary.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", summary["request_goodput"]))
    lines.append(_row("Output token throughput (tok/s):", summary["output_throughput"]))
    lines.append(_row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]))
    lines.append(_row("Peak concurrent requests:", float(summary["max_concurrent_requests"])))
    lines.append(_row("Total Token throughput (tok/s):", summary["total_token_throughput"]))
    lines.append(_row("Cached prompt tokens:", summary["total_cached_tokens"]))
    lines.append(_row("Prefix cache hit rate (%):", _percent(summary["prefix_cache_hit_rate"])))
    for name in metrics:
        short, header = HEADERS[name]
        lines.append(_rule(header, "-"))
        lines.append(_row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", summary[f"median_{name}_ms"]))
        for p in percentiles:
            word = percentile_key(p)
            lines.append(_row(f"P{word} {short} (ms):", summary[f"p{word}_{name}_ms"]))
    if "kv_pulls" in summary:
        lines += _kv_pulls(summary)
    if "per_kind" in summary:
        lines += _per_kind(summary["per_kind"], percentiles)
    if "per_turn" in summary:
        lines += _per_turn(summary["per_turn"], percentiles)
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"


def _kv_pulls(summary: dict) -> list[str]:
    """The hand-off section (services/bench/transfer.py); n/a where a ratio has nothing to divide."""

    def value(key: str, scale: float = 1.0) -> object:
        return "n/a" if summary[key] is None else float(summary[key]) * scale

    return [
        _rule("KV hand-off (decode pulls, worker /metrics)", "-"),
        _row("KV pulls:", summary["kv_pulls"]),
        _row("Mean KV pull (ms):", value("mean_kv_pull_ms")),
        _row("KV pull / TTFT (%, means):", value("kv_pull_share_of_ttft", 100.0)),
        _row("KV pull / E2EL (%, totals):", value("kv_pull_share_of_e2el", 100.0)),
        _row("KV bytes pulled per request:", value("kv_bytes_per_request")),
    ]


def _per_kind(per_kind: dict[str, dict], percentiles: Sequence[float]) -> list[str]:
    high = percentile_key(max(percentiles))
    cols = [("TTFT", "ttft", "median"), ("TTFT", "ttft", f"p{high}"), ("TPOT", "tpot", "median"),
            ("TPOT", "tpot", f"p{high}"), ("ITL", "itl", f"p{high}")]  # fmt: skip
    heads = [f"{short} {'p50' if stat == 'median' else stat}" for short, _, stat in cols]
    lines = [_rule("Per kind (ms)", "-"), f"{'kind':<10}{'ok':>5}{'fail':>5}" + "".join(f"{h:>10}" for h in heads)]
    for kind, s in per_kind.items():
        values = "".join(f"{s[f'{stat}_{name}_ms']:>10.2f}" for _, name, stat in cols)
        lines.append(f"{kind:<10}{s['completed']:>5}{s['failed']:>5}{values}")
    return lines


def _percent(share: float | None) -> object:
    """A share as a percentage, "n/a" when the server did not report what it is made of."""
    return "n/a" if share is None else share * 100.0


def _per_turn(per_turn: dict[str, dict], percentiles: Sequence[float]) -> list[str]:
    """One line per conversation turn: how its prompt grows, how much the cache served, what TTFT did."""
    high = percentile_key(max(percentiles))
    heads = ["prompt tok", "cached %", "TTFT p50", f"TTFT p{high}"]
    lines = [_rule("Per turn (ms)", "-"), f"{'turn':<6}{'ok':>5}{'fail':>5}" + "".join(f"{h:>11}" for h in heads)]
    for turn, s in per_turn.items():
        mean_prompt = s["total_input_tokens"] / s["completed"] if s["completed"] else 0.0
        cached = _percent(s["prefix_cache_hit_rate"])
        cached_text = cached if isinstance(cached, str) else f"{cached:.1f}"
        values = [f"{mean_prompt:.0f}", cached_text, f"{s['median_ttft_ms']:.2f}", f"{s[f'p{high}_ttft_ms']:.2f}"]
        lines.append(f"{turn:<6}{s['completed']:>5}{s['failed']:>5}" + "".join(f"{v:>11}" for v in values))
    return lines
