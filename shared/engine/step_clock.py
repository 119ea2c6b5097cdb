"""Where an engine step's wall time goes: perf_counter stamps at the step's phase boundaries.

An engine runs without one (`Engine.step_clock` is None) and then pays one attribute test per boundary; a
benchmark (benchmarks/step_profile.py) hands one to `Engine.time_steps` and reads `steps` after. Each phase is
the time from the previous stamp to its own, so a step's phases add up to its wall time exactly:

    schedule   the scheduler's plan                          (Engine.step)
    inputs     the flat batch: ids, positions, sampling rows  (ModelRunner.execute)
    metadata   attention metadata and the staged id/position tensor (forward_step)
    model      the forward pass and the logits (on CUDA: their launch, unless `sync` is given)
    sample     grammar masks, the sampler, the runner's output dicts
    update     the scheduler's update, the request outputs, forks, layer streams (Engine.step)
    stream_out handing the outputs to the service's event loop (AsyncEngine), stamped after the step returns

A worker group's leader runs its model calls through its op stream: there `metadata` is part of `model`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("schedule", "inputs", "metadata", "model", "sample", "update", "stream_out")
HOST_PHASES = tuple(p for p in PHASES if p != "model")  # everything outside the model's forward


@dataclass
class StepTimes:
    """One step: how many sequences and tokens it ran, and the seconds of each phase it stamped."""

    seqs: int = 0
    tokens: int = 0
    decode_only: bool = False  # every sequence fed back one sampled token
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.phases.values())


class StepClock:
    """Collects `StepTimes`, one per step begun. `sync`: called before every stamp (torch.cuda.synchronize on
    CUDA, so that a phase holds its kernels and not only their launch; it costs each step a few syncs)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.steps: list[StepTimes] = []
        self._sync = sync
        self._last = 0.0

    def begin(self) -> None:
        """A new step starts now."""
        self.steps.append(StepTimes())
        self._last = time.perf_counter()

    def note(self, seqs: int, tokens: int, decode_only: bool) -> None:
        """What the current step runs (after its plan)."""
        step = self.steps[-1]
        step.seqs, step.tokens, step.decode_only = seqs, tokens, decode_only

    def mark(self, phase: str) -> None:
        """The current step's `phase` ends now (a phase stamped twice adds up)."""
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        phases = self.steps[-1].phases
        phases[phase] = phases.get(phase, 0.0) + now - self._last
        self._last = now
