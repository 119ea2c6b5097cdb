"""Expert routing traces (torch-free): per engine step, per sparse layer, the tokens routed to each logical
expert, with the role (phase) that served them — what a worker records with `--record-expert-trace PATH`
(shared/worker/expert_recorder.py) and what benchmarks/eplb_sim.py replays and `pdserve experts show` draws.

Counts, not per-token expert ids: a rank's load under any placement is a function of the per-expert counts
alone (replicas split their expert's tokens evenly, shared/sharding/placement.py `rank_loads`), which is all the
planner, the live policy (rebalance.py) and the simulation look at. Per-token ids would only matter for what a
placement does to the all-to-all's traffic (a token's experts on one rank or several), which nothing here
plans for; they would cost top_k ids per token per layer instead of E counts per layer per step.

The file is JSON lines, appendable. A header line starts a segment (a worker that restarts appending to the
same path starts a new one):

    {"format": "pdserve-expert-trace", "version": 1, "role": "decode", "model": ..., "worker": ...,
     "layers": [1, 3], "num_experts": 8, "top_k": 2}

then one line per step:

    {"step": 12, "t": 1765000000.125, "step_s": 0.031, "prefill_tokens": 0, "decode_tokens": 16,
     "counts": [[tokens per expert] per layer, in the header's layer order]}

`step` is the engine's step number (steps without a scheduled batch are not steps), `t` the wall-clock time
the step ended, `step_s` its engine time, and the token figures what it computed of prompts and of decodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "pdserve-expert-trace"
VERSION = 1


class TraceError(ValueError):
    """A file that is not an expert trace, or one whose lines contradict its header (the message says where)."""


@dataclass(frozen=True)
class TraceHeader:
    role: str  # prefill | decode | mixed (the worker's role: the phase its steps served)
    model: str
    layers: tuple[int, ...]  # the sparse layers, the order of each step's `counts`
    num_experts: int
    top_k: int
    worker: str = ""

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "role": self.role,
            "model": self.model,
            "worker": self.worker,
            "layers": list(self.layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
        }


@dataclass(frozen=True)
class TraceStep:
    step: int
    t: float
    step_s: float
    prefill_tokens: int
    decode_tokens: int
    counts: tuple[tuple[int, ...], ...]  # per layer (header order), tokens per expert

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "t": round(self.t, 6),
            "step_s": round(self.step_s, 6),
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "counts": [list(c) for c in self.counts],
        }


@dataclass
class ExpertTrace:
    """One segment: a header and its steps, in order."""

    header: TraceHeader
    steps: list[TraceStep] = field(default_factory=list)

    @property
    def role(self) -> str:
        return self.header.role

    def load(self, steps: Iterable[TraceStep] | None = None) -> dict[int, list[int]]:
        """Layer → tokens per expert summed over `steps` (default: all): the planner's statistics."""
        totals = [[0] * self.header.num_experts for _ in self.header.layers]
        for s in self.steps if steps is None else steps:
            for acc, counts in zip(totals, s.counts, strict=True):
                for e, c in enumerate(counts):
                    acc[e] += c
        return dict(zip(self.header.layers, totals, strict=True))


def header_line(header: TraceHeader) -> str:
    return json.dumps(header.to_json(), separators=(",", ":")) + "\n"


def step_line(step: TraceStep) -> str:
    return json.dumps(step.to_json(), separators=(",", ":")) + "\n"


def write_trace(path: str | Path, trace: ExpertTrace, append: bool = False) -> None:
    """The whole trace as one segment (tests, synthesised traces); the recorder writes incrementally."""
    with open(path, "a" if append else "w") as f:
        f.write(header_line(trace.header))
        f.writelines(step_line(s) for s in trace.steps)


def parse_trace(text: str, where: str = "trace") -> list[ExpertTrace]:
    """Every segment of a trace file's text, in file order. A truncated last line (a worker killed mid-write)
    is dropped; any other malformed line is an error."""
    traces: list[ExpertTrace] = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # the line being written when the worker died
                break
            raise TraceError(f"{where}:{n}: not JSON: {exc}") from exc
        if obj.get("format") == FORMAT:
            traces.append(ExpertTrace(_header(obj, f"{where}:{n}")))
            continue
        if not traces:
            raise TraceError(f"{where}:{n}: a step before any header: not a {FORMAT} file")
        traces[-1].steps.append(_step(obj, traces[-1].header, f"{where}:{n}"))
    if not traces:
        raise TraceError(f"{where}: no {FORMAT} header (an empty file, or not an expert trace)")
    return traces


def read_trace(path: str | Path) -> list[ExpertTrace]:
    return parse_trace(Path(path).read_text(), str(path))


def _header(obj: dict, where: str) -> TraceHeader:
    if obj.get("version") != VERSION:
        raise TraceError(f"{where}: trace version {obj.get('version')!r}, this reader knows {VERSION}")
    try:
        return TraceHeader(
            role=str(obj["role"]),
            model=str(obj.get("model", "")),
            layers=tuple(int(x) for x in obj["layers"]),
            num_experts=int(obj["num_experts"]),
            top_k=int(obj["top_k"]),
            worker=str(obj.get("worker", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: header needs role, layers, num_experts, top_k: {exc!r}") from exc


def _step(obj: dict, header: TraceHeader, where: str) -> TraceStep:
    try:
        counts = tuple(tuple(int(c) for c in layer) for layer in obj["counts"])
        step = TraceStep(
            int(obj["step"]),
            float(obj["t"]),
            float(obj.get("step_s", 0.0)),
            int(obj.get("prefill_tokens", 0)),
            int(obj.get("decode_tokens", 0)),
            counts,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: a step needs step, t and counts: {exc!r}") from exc
    if len(counts) != len(header.layers) or any(len(c) != header.num_experts for c in counts):
        raise TraceError(
            f"{where}: counts are {len(counts)} layers x {[len(c) for c in counts][:3]}..., the header says "
            f"{len(header.layers)} layers x {header.num_experts} experts"
        )
    return step
