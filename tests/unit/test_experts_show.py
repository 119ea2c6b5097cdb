"""`pdserve experts show`: a role's expert and rank load over time, from a trace, a scrape or a live worker's
metrics URL, drawn as a PNG (its header checked: a real image of the expected size), and the figures it draws
(relative loads, columns as differences of scrapes, one role's series of a scrape)."""

from __future__ import annotations

import struct

import pytest

from services.cli import main as cli_main
from services.experts_show import expert_rows, from_scrape, from_trace, from_url, rank_rows, render
from shared.sharding.expert_trace import ExpertTrace, TraceHeader, TraceStep, write_trace
from shared.sharding.placement import ExpertPlacement, parse_stats

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _trace(tmp_path):
    path = tmp_path / "t.jsonl"
    hot = [(6, 2, 0, 0), (0, 0, 4, 4)]  # layer 1 then layer 3, 4 experts
    for i, role in enumerate(("prefill", "decode")):
        steps = [TraceStep(n, 10.0 + n, 1.0, 8, 0, tuple(hot)) for n in range(6)]
        write_trace(path, ExpertTrace(TraceHeader(role, "m", (1, 3), 4, 2), steps), append=i > 0)
    return path


def _scrape(values: dict[tuple[str, int, int], float]) -> str:
    lines = ["# TYPE pdserve:moe_expert_tokens_total counter"]
    for (role, layer, expert), v in values.items():
        labels = f'model_name="m",role="{role}",layer="{layer}",expert="{expert}"'
        lines.append(f"pdserve:moe_expert_tokens_total{{{labels}}} {v}")
    return "\n".join(lines) + "\n"


def test_show_draws_a_trace_as_a_png(tmp_path, capsys):
    out = tmp_path / "decode.png"
    assert cli_main(["experts", "show", "--trace", str(_trace(tmp_path)), "--role", "decode", "--ep", "2"] + [
        "--columns", "3", "--out", str(out)
    ]) == 0  # fmt: skip
    assert _png_size(out) == (1100, 840)  # 11 x 8.4 inches at 100 dpi: three panels
    printed = capsys.readouterr().out
    assert "decode: 3 column(s)" in printed and "layer 1: busiest rank / mean rank load 2.000 (ep=2)" in printed
    # without a placement: the expert panel alone
    alone = render(from_trace(_trace(tmp_path), "prefill", 3), None, tmp_path / "p.png", dpi=50)
    assert _png_size(alone) == (550, 160)


def test_trace_columns_and_relative_loads(tmp_path):
    load = from_trace(_trace(tmp_path), "decode", columns=3)
    assert (load.role, load.layers, load.num_experts, len(load.counts)) == ("decode", [1, 3], 4, 3)
    assert load.ends_s == pytest.approx([2.0, 4.0, 6.0]) and load.counts[0][1] == [12, 4, 0, 0]
    rows = expert_rows(load)  # (layer, expert) rows: tokens over the layer's mean expert's (2 per column here)
    assert rows[0] == pytest.approx([3.0] * 3) and rows[2] == [0.0] * 3 and rows[6] == pytest.approx([2.0] * 3)
    ranks, imbalance = rank_rows(load, ExpertPlacement.default(4, 2, [1, 3]))
    assert ranks[0] == pytest.approx([2.0] * 3) and ranks[3] == pytest.approx([2.0] * 3)
    assert imbalance == pytest.approx([2.0] * 3)
    with pytest.raises(ValueError, match="choose one with --role"):
        from_trace(_trace(tmp_path))
    with pytest.raises(ValueError, match="has no mixed steps"):
        from_trace(_trace(tmp_path), "mixed")


def test_a_scrape_shows_one_roles_series(tmp_path, capsys):
    text = _scrape({("decode", 1, 0): 30, ("decode", 1, 3): 10, ("prefill", 1, 1): 500, ("prefill", 1, 0): 5})
    assert parse_stats(text, "decode") == {1: [30, 0, 0, 10]} and parse_stats(text) == {1: [35, 500, 0, 10]}
    load = from_scrape(text, "decode", num_experts=6)
    assert (load.layers, load.num_experts, load.counts) == ([1], 6, [{1: [30, 0, 0, 10, 0, 0]}])
    path = tmp_path / "scrape.txt"
    path.write_text(text)
    out = tmp_path / "s.png"
    assert cli_main(["experts", "show", "--stats", str(path), "--role", "decode", "--ep", "2", "--out", str(out)]) == 0
    assert _png_size(out) == (1100, 840)
    assert "layer 1: busiest rank / mean rank load 1.500" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--role is needed"):
        cli_main(["experts", "show", "--stats", str(path), "--out", str(out)])
    with pytest.raises(ValueError, match="no pdserve:moe_expert_tokens_total samples of role mixed"):
        from_scrape(text, "mixed")


def test_a_live_url_gives_columns_of_differences():
    scrapes = iter(
        [
            _scrape({("decode", 2, 0): 10, ("decode", 2, 1): 5}),
            _scrape({("decode", 2, 0): 14, ("decode", 2, 1): 5, ("decode", 2, 2): 3}),
            _scrape({("decode", 2, 0): 2, ("decode", 2, 1): 1}),  # the worker restarted: counters from zero
        ]
    )
    asked, slept = [], []
    load = from_url(
        "http://w:9/metrics", "decode", 3, 0.5, fetch=lambda url: asked.append(url) or next(scrapes), sleep=slept.append
    )
    assert asked == ["http://w:9/metrics"] * 3 and slept == [0.5, 0.5]
    assert load.num_experts == 3 and load.counts == [{2: [4, 0, 3]}, {2: [2, 1, 0]}]
    with pytest.raises(ValueError, match="at least 2"):
        from_url("http://w:9/metrics", "decode", 1, 0.5, fetch=lambda url: "")
