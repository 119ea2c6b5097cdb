"""A worker's live cost coefficients, for the gateway's choice of prefill path (services/gateway/prefill_path.py),
published in every heartbeat as a `PathCalibration`.

- Steps (every role), measured from the engine's cumulative counters after each step (`EngineStats`: steps, prompt
  and decode tokens, seconds inside steps): a step that computed prompt tokens is a sample of the prefill line,
  seconds ≈ prefill_step + tokens / prefill_tokens_per_s (on a decode worker its intercept includes the running
  batch's decode); a step that only decoded is a sample of decode_step. Observed ON THE ENGINE THREAD (the
  worker's on_state hook), which publishes an immutable `StepCosts` the loop reads, as EngineLoad does.
- KV pulls (decode workers), observed on the loop when a pull completes: seconds ≈ pull_overhead + bytes ·
  transfer cost per byte.

Each is an exponentially weighted fit of the last ~1/ALPHA samples (ewma.py); None until its first sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.engine import EngineStats
from shared.messages import PathCalibration
from shared.worker.ewma import Ewma, EwmaLine

ALPHA = 0.1  # about the last ten samples count
MB = 1e6


@dataclass(frozen=True)
class StepCosts:
    """The step coefficients as last fitted (a snapshot: the engine thread replaces it whole)."""

    prefill_tokens_per_s: float | None = None
    prefill_step_ms: float | None = None
    decode_step_ms: float | None = None


class StepCalibration:
    """Fits the step coefficients from successive `EngineStats` (see the module). `observe` runs on the engine
    thread only; `costs` is read anywhere."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self._prefill = EwmaLine(alpha)  # a step's seconds against its prompt tokens
        self._decode = Ewma(alpha)  # a decode-only step's seconds
        self._last: tuple[int, int, int, float] | None = None  # (steps, prefill tokens, decode tokens, step_s)
        self.costs = StepCosts()

    def observe(self, stats: EngineStats) -> None:
        """After a step (or any command: then nothing moved). Only a delta of exactly one step is a sample: what
        two steps did together cannot be told apart."""
        now = (stats.steps, stats.prefill_tokens, stats.decode_tokens, stats.step_s)
        last, self._last = self._last, now
        if last is None or now[0] - last[0] != 1:
            return
        prefill, decode, seconds = now[1] - last[1], now[2] - last[2], now[3] - last[3]
        if prefill > 0:
            self._prefill.add(prefill, seconds)
        elif decode > 0:
            self._decode.add(seconds)
        else:
            return
        line, step = self._prefill.fit(), self._decode.value
        self.costs = StepCosts(
            prefill_tokens_per_s=None if line is None else 1.0 / line.slope,
            prefill_step_ms=None if line is None else line.intercept * 1e3,
            decode_step_ms=None if step is None else step * 1e3,
        )


class PullCalibration:
    """Fits the KV pull line from completed pulls (on the worker's loop)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self._line = EwmaLine(alpha)  # a pull's seconds against its bytes

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0:
            self._line.add(nbytes, seconds)

    def fitted(self) -> tuple[float | None, float | None]:
        """(ms per MB, fixed ms per pull), or (None, None) before the first pull."""
        line = self._line.fit()
        return (None, None) if line is None else (line.slope * MB * 1e3, line.intercept * 1e3)


def path_calibration(steps: StepCosts, pulls: PullCalibration, kv_bytes_per_token: int) -> PathCalibration:
    """What a heartbeat carries (the engine's queue goes in the heartbeat's own `waiting_tokens`)."""
    ms_per_mb, overhead_ms = pulls.fitted()
    return PathCalibration(
        prefill_tokens_per_s=steps.prefill_tokens_per_s,
        prefill_step_ms=steps.prefill_step_ms,
        decode_step_ms=steps.decode_step_ms,
        kv_transfer_ms_per_mb=ms_per_mb,
        kv_pull_overhead_ms=overhead_ms,
        kv_bytes_per_token=kv_bytes_per_token,
    )
