"""`--record-expert-trace PATH`: a worker appends, per engine step, every sparse layer's tokens per expert to an
expert routing trace (format: shared/sharding/expert_trace.py), with its role and the step's number.

Where the counts come from: `MoE.expert_load`, which the MoE blocks keep on the model's device anyway (the
heartbeat reads and zeroes them once per beat). The recorder looks at them on the engine thread after every
step and after every call (AsyncEngine's `on_state`, Worker._observe): after a step it keeps the difference
from its previous look (that step's counts, as a device tensor); after a call it only takes a new baseline,
so a heartbeat zeroing the counters, or a call running the model outside a step, never shows as traffic.

Cost: off, nothing (the worker holds None). On, per step one stack of (sparse layers, E) int64 and a
subtraction, on the device; every `flush_steps` steps one host read of the stacked steps, handed to a writer
thread that formats and appends the lines. Nothing waits for the disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import torch

from shared.engine.engine import Engine
from shared.sharding.expert_trace import TraceHeader, TraceStep, header_line, step_line

log = logging.getLogger(__name__)

FLUSH_STEPS = 64  # steps per host read (and per batch of lines to the writer)


class ExpertTraceRecorder:
    def __init__(
        self, path: str | Path, engine: Engine, role: str, model_name: str, worker: str = "", flush_steps: int = 0
    ) -> None:
        moes = engine.model.sparse_layers()
        if not moes:
            raise ValueError(f"--record-expert-trace records routed experts: {engine.config.model} has none")
        self.path = Path(path)
        self._moes = list(moes.values())
        self.header = TraceHeader(
            role=str(role),
            model=model_name,
            layers=tuple(moes),
            num_experts=engine.model.config.num_experts,
            top_k=engine.model.config.num_experts_per_tok,
            worker=worker,
        )
        self._flush_steps = flush_steps or FLUSH_STEPS
        self._last: torch.Tensor | None = None  # the counters at the previous look, (L, E)
        self._seen = _Totals.of(engine)
        self._pending: list[tuple[torch.Tensor, TraceStep]] = []  # device deltas, and the step without counts
        self.steps_recorded = 0
        self._lines: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 — the writer thread owns it until close()
        self._lines.put([header_line(self.header)])
        self._writer = threading.Thread(target=self._write, name="expert-trace", daemon=True)
        self._writer.start()
        log.info("recording expert routing (%s, %d sparse layers) to %s", role, len(self._moes), self.path)

    def _counters(self) -> torch.Tensor:
        return torch.stack([m.expert_load for m in self._moes])

    def observe(self, engine: Engine) -> None:
        """On the engine thread, after a step or a call (Worker._observe): record the step, if one ran."""
        counts = self._counters()
        now = _Totals.of(engine)
        if self._last is not None and now.steps != self._seen.steps:
            step = TraceStep(
                step=now.steps,
                t=time.time(),
                step_s=now.step_s - self._seen.step_s,
                prefill_tokens=now.prefill - self._seen.prefill,
                decode_tokens=now.decode - self._seen.decode,
                counts=(),
            )
            self._pending.append((counts - self._last, step))
            if len(self._pending) >= self._flush_steps:
                self.flush()
        self._last, self._seen = counts, now

    def flush(self) -> None:
        """The pending steps to the writer (one host read of their counts). On the engine thread, or after it
        stopped."""
        if not self._pending:
            return
        deltas = torch.stack([d for d, _ in self._pending]).cpu().tolist()  # (steps, L, E)
        lines = [
            step_line(TraceStep(s.step, s.t, s.step_s, s.prefill_tokens, s.decode_tokens, tuple(map(tuple, c))))
            for (_, s), c in zip(self._pending, deltas, strict=True)
        ]
        self.steps_recorded += len(lines)
        self._pending = []
        self._lines.put(lines)

    def close(self) -> None:
        """Write what is pending and close the file (after the engine thread stopped)."""
        self.flush()
        self._lines.put(None)
        self._writer.join(30)

    def _write(self) -> None:
        failed = False
        while (lines := self._lines.get()) is not None:
            if failed:  # keep taking them: nothing may pile up behind a broken file
                continue
            try:
                self._file.writelines(lines)
                self._file.flush()
            except OSError as exc:  # a full disk must not take the worker down: the trace stops, serving goes on
                log.error("expert trace %s: writing failed (%r); recording stops", self.path, exc)
                failed = True
        self._file.close()


class _Totals:
    """The engine's cumulative step figures at one look."""

    __slots__ = ("steps", "step_s", "prefill", "decode")

    def __init__(self, steps: int, step_s: float, prefill: int, decode: int) -> None:
        self.steps, self.step_s, self.prefill, self.decode = steps, step_s, prefill, decode

    @classmethod
    def of(cls, engine: Engine) -> _Totals:
        s = engine.stats
        return cls(s.steps, s.step_s, s.prefill_tokens, s.decode_tokens)
