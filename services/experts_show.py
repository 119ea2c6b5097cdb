"""`pdserve experts show`: one role's expert load per sparse layer, and the load of each expert-parallel rank
under a placement, over time, drawn as heatmaps (PNG), from

- an expert routing trace (`--record-expert-trace`, shared/sharding/expert_trace.py): the steps binned into at
  most `columns` equal spans of time;
- a worker's /metrics scrape (`pdserve:moe_expert_tokens_total`, one role's series): one column, the counters
  since the worker started;
- a live worker's metrics URL: `samples` scrapes `interval_s` apart, each column what was routed between two.

Each expert's cell is its tokens over the layer's mean expert's in that column (1 = its fair share); each rank's
is its tokens over the mean rank's (1 = balanced), under `--placement` or the placement a group with `--ep` and
`--redundant` starts with (the contiguous split; with redundant slots the planner's for no load), replicas
splitting their expert's tokens as the dispatch does. The line below is busiest rank / mean summed over the
layers (what the MoE layers of a step wait for: the live policy's predicted imbalance, rebalance.py).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.sharding.expert_trace import read_trace
from shared.sharding.placement import ExpertPlacement, PlacementError, parse_stats, rank_loads
from shared.sharding.rebalance import predicted_imbalance


@dataclass
class LoadOverTime:
    """One role's expert load in columns of time: counts[c][layer] = tokens per expert in column c."""

    role: str
    layers: list[int]
    num_experts: int
    ends_s: list[float]  # each column's end, seconds from the first column's start (0 for a lone scrape)
    counts: list[dict[int, list[int]]]
    source: str

    def totals(self) -> dict[int, list[int]]:
        out = {layer: [0] * self.num_experts for layer in self.layers}
        for column in self.counts:
            for layer in self.layers:
                out[layer] = [a + b for a, b in zip(out[layer], column[layer], strict=True)]
        return out


# ---- sources ------------------------------------------------------------------------------------------------


def from_trace(path: str | Path, role: str | None = None, columns: int = 120) -> LoadOverTime:
    traces = read_trace(path)
    roles = sorted({t.role for t in traces})
    if role is None:
        if len(roles) > 1:
            raise PlacementError(f"{path} holds the roles {roles}: choose one with --role")
        role = roles[0]
    chosen = [t for t in traces if t.role == role]
    if not chosen:
        raise PlacementError(f"{path} has no {role} steps (roles: {roles})")
    header = chosen[0].header
    steps = sorted((s for t in chosen for s in t.steps), key=lambda s: s.t)
    if not steps:
        raise PlacementError(f"{path}: the {role} trace has no steps yet")
    start = steps[0].t - steps[0].step_s
    span = max(steps[-1].t - start, 1e-9)
    n = max(1, min(columns, len(steps)))
    bins = [[[0] * header.num_experts for _ in header.layers] for _ in range(n)]
    for s in steps:  # a step falls in the column of its midpoint
        column = bins[min(n - 1, int((s.t - s.step_s / 2 - start) / span * n))]
        for acc, counts in zip(column, s.counts, strict=True):
            for e, c in enumerate(counts):
                acc[e] += c
    return LoadOverTime(
        role,
        list(header.layers),
        header.num_experts,
        [span * (i + 1) / n for i in range(n)],
        [dict(zip(header.layers, column, strict=True)) for column in bins],
        f"trace {path}: {len(steps)} steps over {span:.1f} s",
    )


def _widen(stats: dict[int, list[int]], width: int) -> dict[int, list[int]]:
    return {layer: counts + [0] * (width - len(counts)) for layer, counts in stats.items()}


def from_scrape(text: str, role: str, num_experts: int | None = None, source: str = "scrape") -> LoadOverTime:
    stats = parse_stats(text, role)
    width = num_experts or max(len(c) for c in stats.values())
    return LoadOverTime(role, sorted(stats), width, [0.0], [_widen(stats, width)], source)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 — an operator's own worker
        return response.read().decode()


def from_url(
    url: str,
    role: str,
    samples: int,
    interval_s: float,
    num_experts: int | None = None,
    fetch: Callable[[str], str] = _get,
    sleep: Callable[[float], None] = time.sleep,
) -> LoadOverTime:
    """`samples` scrapes of a live worker, `interval_s` apart: each column is what its counters gained between
    two (a counter that went back — the worker restarted — counts from zero)."""
    if samples < 2:
        raise PlacementError("--samples must be at least 2: a column is the difference of two scrapes")
    scrapes, stamps = [], []
    for i in range(samples):
        if i:
            sleep(interval_s)
        stamps.append(time.monotonic())
        scrapes.append(parse_stats(fetch(url), role))
    layers = sorted({layer for s in scrapes for layer in s})
    width = num_experts or max(len(c) for s in scrapes for c in s.values())
    scrapes = [_widen({layer: s.get(layer, []) for layer in layers}, width) for s in scrapes]
    columns = []
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        columns.append(
            {
                layer: [a - b if a >= b else a for a, b in zip(after[layer], before[layer], strict=True)]
                for layer in layers
            }
        )
    ends = [t - stamps[0] for t in stamps[1:]]
    return LoadOverTime(role, layers, width, ends, columns, f"{url}: {samples} scrapes {interval_s:g} s apart")


# ---- the picture --------------------------------------------------------------------------------------------


def _relative(values: list[float]) -> list[float]:
    mean = sum(values) / len(values) if values else 0.0
    return [v / mean if mean > 0 else 0.0 for v in values]


def expert_rows(load: LoadOverTime) -> list[list[float]]:
    """Rows (layer, expert) in layer order, columns in time: tokens over the layer's mean expert's."""
    rows: list[list[float]] = []
    for layer in load.layers:
        per_column = [_relative([float(c) for c in column[layer]]) for column in load.counts]
        rows += [[col[e] for col in per_column] for e in range(load.num_experts)]
    return rows


def rank_rows(load: LoadOverTime, placement: ExpertPlacement) -> tuple[list[list[float]], list[float]]:
    """Rows (layer, rank), columns in time: tokens over the mean rank's; and per column busiest / mean summed
    over the layers."""
    per_column = [rank_loads(placement, column) for column in load.counts]
    rows = []
    for layer in load.layers:
        relative = [_relative(loads[layer]) for loads in per_column]
        rows += [[col[r] for col in relative] for r in range(placement.ep)]
    return rows, [predicted_imbalance(placement, column) for column in load.counts]


def render(load: LoadOverTime, placement: ExpertPlacement | None, out: str | Path, dpi: int = 100) -> Path:
    """The heatmaps (and the imbalance line with a placement) as a PNG at `out`: matplotlib's Agg canvas, no
    display, no pyplot state (as services/trace/timeline.py draws)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    columns = len(load.counts)
    panels = 1 if placement is None else 3
    ratios = [3] if placement is None else [3, 2, 1]
    fig = Figure(figsize=(11, 3.2 + 2.6 * (panels - 1)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, height_ratios=ratios, sharex=columns > 1, squeeze=False)[:, 0]
    extent_x = (0.0, load.ends_s[-1]) if columns > 1 else (-0.5, 0.5)
    top = max((max(r) for r in expert_rows(load) if r), default=1.0)

    def heat(ax, rows, per_layer, label, **kw):
        image = ax.imshow(
            rows, aspect="auto", interpolation="nearest", extent=(*extent_x, len(rows), 0), origin="upper", **kw
        )
        for i in range(1, len(load.layers)):
            ax.axhline(i * per_layer, color="white", linewidth=0.6)
        ax.set_yticks([(i + 0.5) * per_layer for i in range(len(load.layers))])
        ax.set_yticklabels([f"layer {layer}" for layer in load.layers])
        fig.colorbar(image, ax=ax, label=label, pad=0.01)

    heat(
        axes[0],
        expert_rows(load),
        load.num_experts,
        "tokens / mean expert's",
        cmap="magma",
        vmin=0.0,
        vmax=max(top, 1.0),
    )
    axes[0].set_title(f"{load.role}: expert load per sparse layer ({load.num_experts} experts each)  —  {load.source}")
    if placement is not None:
        rows, imbalance = rank_rows(load, placement)
        hottest = max(max(r) for r in rows) if rows else 2.0
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(hottest, 1.01))
        heat(axes[1], rows, placement.ep, "tokens / mean rank's", cmap="coolwarm", norm=norm)
        axes[1].set_title(f"rank load at ep={placement.ep}, {placement.slots_per_rank} slots per rank")
        xs = load.ends_s if columns > 1 else [0.0]
        axes[2].plot(xs, imbalance, marker="o" if columns == 1 else None, color="black")
        axes[2].axhline(1.0, color="grey", linewidth=0.6, linestyle=":")
        axes[2].set_ylabel("busiest / mean")
        axes[2].set_ylim(bottom=min(0.95, min(imbalance, default=1.0)))
    axes[-1].set_xlabel("seconds" if columns > 1 else "(one scrape: the counters since the worker started)")
    if columns == 1:
        for ax in axes:
            ax.set_xticks([])
    path = Path(out)
    fig.savefig(path, dpi=dpi)
    return path
