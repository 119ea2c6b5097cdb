"""compare_pd.py's check of the per-request path's cost model: predicted against measured TTFT, per path, from
the gateway's request spans of one run's window."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare_pd import add_path_predictions, path_predictions, predictions_table
from shared.telemetry import tracing


def _span(start_ns: int, path: str | None, predicted_s: float | None, ttft_s: float | None) -> dict:
    attributes = {tracing.PREFILL_PATH: path, tracing.PREFILL_PATH_PREDICTED_TTFT: predicted_s,
                  tracing.GEN_AI_TTFT: ttft_s}  # fmt: skip
    return {
        "trace_id": "t",
        "name": "chat demo",
        "start_ns": start_ns,
        "attributes": {k: v for k, v in attributes.items() if v},
    }


SPANS = [
    _span(10, "local", 0.050, 0.060),
    _span(20, "local", 0.040, 0.050),
    _span(30, "local", 0.060, 0.070),
    _span(40, "remote", 0.400, 0.300),
    _span(50, None, None, None),  # a worker's span: no path
    _span(500, "remote", 9.0, 9.0),  # another run's
]


def test_medians_per_path_within_the_window():
    got = path_predictions(SPANS, (0, 100))
    assert got["local"] == {
        "requests": 3,
        "predicted_ttft_p50_ms": pytest.approx(50.0),
        "measured_ttft_p50_ms": pytest.approx(60.0),
        "measured_over_predicted": pytest.approx(1.2),
    }
    assert got["remote"]["requests"] == 1 and got["remote"]["measured_over_predicted"] == pytest.approx(0.75)
    assert path_predictions(SPANS, (1000, 2000)) == {}


def test_only_runs_of_the_auto_mode_with_spans_get_them(tmp_path):
    (tmp_path / "spans-disaggregated-auto.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SPANS))
    (tmp_path / "spans-disaggregated.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SPANS))
    data = {"runs": [{"mode": "disaggregated-auto", "rate": 1.0, "window_ns": [0, 100]},
                     {"mode": "disaggregated", "rate": 1.0, "window_ns": [0, 100]}]}  # fmt: skip
    add_path_predictions(data, tmp_path)
    auto, remote = data["runs"]
    assert set(auto["prefill_paths"]) == {"local", "remote"} and "prefill_paths" not in remote
    assert "| disaggregated-auto | 1 | local | 3 | 50 | 60 | 1.20 |" in predictions_table(data["runs"])
