"""`pdserve bench`'s KV hand-off section (services/bench/transfer.py): totals parsed from a real exposition of
the workers' histogram, the share against hand-computed values, the empty cases, the printed section."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.bench.metrics import RequestRecord, summarize
from services.bench.report import format_table
from services.bench.transfer import PullTotals, parse_pulls, transfer_share
from shared.telemetry.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS


def exposition(decode: list[float], prefill: list[float], model: str = "m") -> str:
    """What a worker's /metrics shows: the same histogram as shared/telemetry/metrics.py, in a registry of its own."""
    registry = CollectorRegistry()
    hist = Histogram(KV_TRANSFER_SECONDS._name, "x", ("model_name", "role"), registry=registry)
    for role, values in (("decode", decode), ("prefill", prefill)):
        for v in values:
            hist.labels(model, role).observe(v)
    return generate_latest(registry).decode()


def test_parse_counts_decode_pulls_only():
    text = exposition([0.25, 0.5], [4.0, 4.0, 4.0])  # the prefill side's sends must not count
    assert parse_pulls(text) == PullTotals(count=2, seconds=0.75)
    assert parse_pulls("") == PullTotals()
    assert parse_pulls(exposition([], [1.0])) == PullTotals()


def test_parse_adds_the_decode_side_bytes():
    registry = CollectorRegistry()
    counter = Counter(KV_TRANSFER_BYTES._name, "x", ("model_name", "role"), registry=registry)
    counter.labels("m", "decode").inc(4096)
    counter.labels("m", "prefill").inc(9999)  # the sender's count of the same bytes must not add up twice
    text = generate_latest(registry).decode() + exposition([0.5], [])
    assert parse_pulls(text) == PullTotals(count=1, seconds=0.5, bytes=4096)
    share = transfer_share(PullTotals(bytes=1000), PullTotals(count=2, seconds=0.2, bytes=9192),
                           {"mean_ttft_ms": 10.0, "mean_e2el_ms": 20.0, "completed": 4})  # fmt: skip
    assert share["kv_bytes_pulled"] == 8192 and share["kv_bytes_per_request"] == 2048
    assert "KV bytes pulled per request:" in format_table(summarize([], 1.0) | share, (50,))


def test_totals_of_several_workers_and_models_add_up():
    total = parse_pulls(exposition([0.125], [], "a")) + parse_pulls(exposition([0.375, 0.5], [], "b"))
    assert total == PullTotals(count=3, seconds=1.0)


def test_share_against_hand_computed_values():
    before, after = PullTotals(count=2, seconds=0.5), PullTotals(count=6, seconds=0.9)  # the run: 4 pulls, 0.4 s
    summary = {"mean_ttft_ms": 200.0, "mean_e2el_ms": 1000.0, "completed": 4}
    share = transfer_share(before, after, summary)
    assert share["kv_pulls"] == 4
    assert share["mean_kv_pull_ms"] == pytest.approx(100.0)  # 0.4 s / 4
    assert share["kv_pull_share_of_ttft"] == pytest.approx(0.5)  # 100 ms / 200 ms
    assert share["kv_pull_share_of_e2el"] == pytest.approx(0.1)  # 400 ms / (4 × 1000 ms)


def test_nothing_to_divide_reports_none():
    summary = {"mean_ttft_ms": 0.0, "mean_e2el_ms": 0.0, "completed": 0}
    share = transfer_share(PullTotals(1, 1.0), PullTotals(1, 1.0), summary)
    assert share == {"kv_pulls": 0, "mean_kv_pull_ms": None, "kv_pull_share_of_ttft": None,
                     "kv_pull_share_of_e2el": None, "kv_bytes_pulled": 0, "kv_bytes_per_request": None}  # fmt: skip
    one = transfer_share(PullTotals(), PullTotals(1, 0.01), summary)  # a pull but no successful request
    assert one["mean_kv_pull_ms"] == pytest.approx(10.0) and one["kv_pull_share_of_ttft"] is None


def test_the_table_prints_the_section_only_when_measured():
    records = [RequestRecord("a", 10, 3, 0.0, True, ttft_s=0.25, itl_s=[0.25, 0.25], latency_s=0.75, output_tokens=3)]
    summary = summarize(records, 1.0)
    assert "KV hand-off" not in format_table(summary, (50, 99))
    summary |= transfer_share(PullTotals(), PullTotals(3, 0.3), summary)
    table = format_table(summary, (50, 99))
    assert "KV pulls:" in table and "Mean KV pull (ms):" in table and "100.00" in table
    assert f"{summary['kv_pull_share_of_ttft'] * 100:.2f}" in table
