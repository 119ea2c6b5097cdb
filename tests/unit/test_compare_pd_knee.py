"""benchmarks/compare_pd.py without stacks: the knee search's stopping rule and the disaggregated modes' prefill
path."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.compare_pd import knee_passed, mode_spec, next_rate, parse_args


@pytest.mark.parametrize(
    ("goodputs", "passed"),
    [
        ([1.0], False),  # one rate says nothing yet
        ([1.0, 2.0], False),  # still rising
        ([1.0, 1.04], True),  # under 5% more: the knee
        ([1.0, 2.0, 1.5], True),  # falling
        ([2.0, 1.0, 2.05], True),  # compared with the best so far, not the previous one
        ([None, 0.5], False),  # a run without goodput counts as 0
        ([0.0, 0.0], True),  # nothing met the SLOs at either rate
    ],
)
def test_knee_passed(goodputs, passed):
    assert knee_passed(goodputs) is passed


def test_next_rate_goes_on_until_every_mode_is_past_its_knee_or_the_cap():
    rates = [1.0, 2.0]
    assert next_rate(rates, 1.5, 16.0, {"a": [1.0, 1.0], "b": [1.0, 1.9]}) == 3.0  # b still rising
    assert next_rate(rates, 1.5, 16.0, {"a": [1.0, 1.0], "b": [1.0, 0.9]}) == 0.0  # both past
    assert next_rate(rates, 1.5, 2.9, {"a": [1.0, 2.0]}) == 0.0  # 3 would exceed the cap
    with pytest.raises(SystemExit):
        parse_args(["--knee-factor", "1"])


def test_disaggregated_modes_pin_the_prefill_path():
    slos = {"ttft": 2000.0, "tpot": 80.5}
    specs = {
        m: mode_spec(m, Path("/m"), (0, 1), 512, 4096, None, slos) for m in ("disaggregated", "disaggregated-auto")
    }
    assert specs["disaggregated"].env == {"PDSERVE_PREFILL_PATH": "remote"}
    assert specs["disaggregated-auto"].env == {
        "PDSERVE_PREFILL_PATH": "auto",
        "PDSERVE_TTFT_SLO_MS": "2000",
        "PDSERVE_TPOT_SLO_MS": "80.5",
    }  # the cost model aims at the run's SLOs
    assert all((s.prefill, s.decode, s.mixed) == (1, 1, 0) for s in specs.values())
    assert mode_spec("colocated", Path("/m"), (0, 1), 512, 4096, None).env == {}


def test_every_mode_computes_every_prompt():
    """The probes and warm-ups repeat their prompts: a prefix cache would serve them and hide the prefill work
    whose interference compare_pd measures."""
    modes = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-auto")
    for m in modes:
        assert "--no-prefix-caching" in mode_spec(m, Path("/m"), (0, 1), 512, 4096, None).worker_args
