"""benchmarks/prefix_cache.py without stacks: the mode table, the ratios and the report from hand-made summaries."""

from __future__ import annotations

import pytest

from benchmarks import prefix_cache
from benchmarks.prefix_cache import MODES, WORKLOADS, parse_args, ratios, report


def _run(ttft_p50: float, hit: float | None, failed: int = 0, per_turn: dict | None = None) -> dict:
    summary = {"completed": 10, "failed": failed, "median_ttft_ms": ttft_p50, "p99_ttft_ms": 2 * ttft_p50,
               "request_throughput": 1.5, "output_throughput": 20.0, "prefix_cache_hit_rate": hit,
               "kv_bytes_per_request": 4096.0}  # fmt: skip
    if per_turn is not None:
        summary["per_turn"] = per_turn
    return {"summary": summary}


def _turn(ttft: float, hit: float | None) -> dict:
    return {"median_ttft_ms": ttft, "prefix_cache_hit_rate": hit}


RUNS = {
    "no-cache": {"shared-prefix": _run(400.0, None), "multi-turn": _run(300.0, 0.0, per_turn={"1": _turn(200, 0.0)})},
    "cache-queue": {"shared-prefix": _run(250.0, 0.4), "multi-turn": _run(200.0, 0.3)},
    "cache-kv-aware": {"shared-prefix": _run(100.0, 0.8, failed=1),
                       "multi-turn": _run(150.0, 0.6, per_turn={"1": _turn(210, 0.0), "2": _turn(90, 0.7)})},
}  # fmt: skip


def test_modes_say_how_each_stack_differs():
    assert list(MODES) == ["no-cache", "cache-queue", "cache-kv-aware-whole-pulls", "cache-kv-aware"]
    remote = {"PDSERVE_PREFILL_PATH": "remote"}  # every mode disaggregates: the path choice is not measured here
    assert all(m.env.items() >= remote.items() for m in MODES.values())
    assert "--no-prefix-caching" in MODES["no-cache"].worker_args
    assert MODES["cache-queue"].env == remote | {"PDSERVE_KV_AWARE_ROUTING": "0"}
    assert MODES["cache-kv-aware-whole-pulls"].env == remote | {"PDSERVE_DECODE_KV_REUSE": "0"}
    assert MODES["cache-kv-aware"].worker_args == () and MODES["cache-kv-aware"].env == remote


def test_ratios():
    got = ratios(RUNS)
    assert got["shared-prefix"]["ttft_p50_kv_aware_over_no_cache"] == pytest.approx(0.25)
    assert got["shared-prefix"]["hit_rate_kv_aware_over_queue"] == pytest.approx(2.0)
    assert got["multi-turn"]["ttft_p50_kv_aware_over_no_cache"] == pytest.approx(0.5)
    assert ratios({"cache-kv-aware": RUNS["cache-kv-aware"]})["multi-turn"] == {
        "ttft_p50_kv_aware_over_no_cache": None, "hit_rate_kv_aware_over_queue": None,
        "kv_bytes_reuse_over_whole_pulls": None}  # fmt: skip


def test_report():
    args = parse_args(["--quick"])
    wl = {k: getattr(args, k) for k in ("groups", "prefix_len", "suffix_len", "num_prompts", "prefix_rate",
                                        "prefix_output_len", "conversations", "turns", "turn_input_len",
                                        "turn_output_len", "think_time", "conversation_rate")}  # fmt: skip
    data = {"date": "d", "config": {"workloads": wl, "modes": list(MODES), "threads": 1},
            "machine": {"model": "m", "cpu": "AMD EPYC", "cpu_count": 2, "torch": "2"}, "runs": RUNS,
            "ratios": ratios(RUNS)}  # fmt: skip
    text = report(data)
    assert "| shared-prefix | cache-kv-aware | 10 / 1 | 100 / 200 | 1.50 | 20 | 80.0% | 4096 |" in text
    assert "| shared-prefix | no-cache | 10 / 0 | 400 / 800 | 1.50 | 20 | — | 4096 |" in text
    assert "| shared-prefix | 0.25 | 2.00 | — |" in text
    assert "| cache-kv-aware | 210 / 0.0% | 90 / 70.0% |" in text and "| no-cache | 200 / 0.0% | — |" in text
    assert "FAILED REQUESTS: cache-kv-aware shared-prefix: 1" in text


def test_arguments():
    assert parse_args([]).num_prompts == prefix_cache.DEFAULTS["num_prompts"]
    assert parse_args(["--workloads", "multi-turn"]).workloads == ["multi-turn"]
    for bad in (["--modes", "cache"], ["--workloads", "random"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert set(WORKLOADS) == {"shared-prefix", "multi-turn"}


def test_the_bytes_ratio_compares_decode_side_reuse_with_whole_pulls():
    whole = _run(150.0, 0.6)
    whole["summary"]["kv_bytes_per_request"] = 5 * 4096.0
    got = ratios(RUNS | {"cache-kv-aware-whole-pulls": {"multi-turn": whole}})
    assert got["multi-turn"]["kv_bytes_reuse_over_whole_pulls"] == pytest.approx(0.2)
