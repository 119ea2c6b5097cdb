"""The prefill path's signals (prefill_path.py) from the live workers' heartbeats: each worker's load and the cost
coefficients it measured (`Heartbeat.path_calibration`, shared/worker/calibration.py), and the documented defaults
(shared/cost_defaults.py) wherever a worker has not measured one yet, or where live calibration is off
(`prefill_path_live_calibration`).

A decode worker that has computed no prompt yet is assumed as fast at prompts as the prefill workers measured (the
same model, on hardware of the same kind), else the default; a transfer coefficient is the mean of what the decode
workers measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean

from services.gateway.prefill_path import DecodeSide, PrefillSide, Transfer
from shared.cost_defaults import (
    DEFAULT_DECODE_STEP_MS,
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_PULL_OVERHEAD_MS,
    DEFAULT_KV_TRANSFER_MS_PER_MB,
    DEFAULT_PREFILL_STEP_MS,
    DEFAULT_PREFILL_TOKENS_PER_S,
)
from shared.messages import Heartbeat, PathCalibration, Role


def _measured(beats: Sequence[Heartbeat], read: Callable[[PathCalibration], float | None]) -> list[float]:
    """Every positive value `read` finds in the beats' calibrations."""
    values = (read(b.path_calibration) for b in beats if b.path_calibration is not None)
    return [v for v in values if v is not None and v > 0]


def _pick(own: float | None, fallback: float, live: bool) -> float:
    return own if live and own is not None and own > 0 else fallback


@dataclass(frozen=True)
class OwnLoad:
    """Prompt tokens of this gateway's own requests on one side (prefill or decode) that the workers' heartbeats
    do not show, or show late, by worker id."""

    queued: Mapping[str, int] = field(default_factory=dict)
    """Waiting in the job queues for the worker to take them: no heartbeat counts JetStream's backlog."""
    taken: Mapping[str, int] = field(default_factory=dict)
    """Taken by the worker, first token not out yet: in its engine, where its heartbeat (one a second) counts them
    only from its next beat. The worker's queue is the larger of this and its heartbeat's (other gateways')."""

    def queue(self, worker_id: str, heartbeat_tokens: int) -> int:
        """The worker's queue before a new prompt: its engine's (as heard, or as taken since) and the job queues'."""
        return max(heartbeat_tokens, self.taken.get(worker_id, 0)) + self.queued.get(worker_id, 0)


class PathSignals:
    """The signals of one choice (see the module)."""

    def __init__(
        self,
        beats: Sequence[Heartbeat],
        live: bool,
        prefill_cached: Mapping[str, int] | None = None,
        prefill_load: OwnLoad | None = None,
        decode_load: OwnLoad | None = None,
        recent_local_tokens: int = 0,
    ) -> None:
        """beats: the live, non-draining workers of the model; live: use what they measured; prefill_cached: the
        prompt's tokens a prefill worker's prefix cache is expected to hold (KV-aware routing's index), by id;
        prefill_load / decode_load: this gateway's own requests the heartbeats do not show yet, on each side;
        recent_local_tokens: the prompt tokens sent down the local path over the last window
        (path_dispatch.LocalLoad), shared evenly by the decode workers."""
        self.live = live
        self._prefill_cached = dict(prefill_cached or {})
        self._prefill_load = prefill_load or OwnLoad()
        self._decode_load = decode_load or OwnLoad()
        self._prefill_beats = [b for b in beats if b.role is Role.PREFILL]
        self._decode_beats = [b for b in beats if b.role is Role.DECODE]
        self._recent_local_share = recent_local_tokens // max(len(self._decode_beats), 1)

    def prefill(self) -> list[PrefillSide]:
        return [self._prefill_side(b) for b in self._prefill_beats]

    def decode(self) -> list[DecodeSide]:
        measured = _measured(self._prefill_beats, lambda c: c.prefill_tokens_per_s) if self.live else []
        prior = fmean(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S
        return [self._decode_side(b, prior) for b in self._decode_beats]

    def transfer(self) -> Transfer:
        beats = self._decode_beats
        per_mb = _measured(beats, lambda c: c.kv_transfer_ms_per_mb) if self.live else []
        overhead = _measured(beats, lambda c: c.kv_pull_overhead_ms) if self.live else []
        per_token = _measured(beats + self._prefill_beats, lambda c: c.kv_bytes_per_token)
        return Transfer(
            s_per_byte=(fmean(per_mb) if per_mb else DEFAULT_KV_TRANSFER_MS_PER_MB) / 1e3 / 1e6,
            overhead_s=(fmean(overhead) if overhead else DEFAULT_KV_PULL_OVERHEAD_MS) / 1e3,
            bytes_per_token=int(max(per_token)) if per_token else DEFAULT_KV_BYTES_PER_TOKEN,
        )

    def _prefill_side(self, beat: Heartbeat) -> PrefillSide:
        c = beat.path_calibration or PathCalibration()
        return PrefillSide(
            worker_id=beat.worker_id,
            # load, not a coefficient: read whether live or not
            queued_tokens=self._prefill_load.queue(beat.worker_id, beat.waiting_tokens),
            tokens_per_s=_pick(c.prefill_tokens_per_s, DEFAULT_PREFILL_TOKENS_PER_S, self.live),
            step_s=_pick(c.prefill_step_ms, DEFAULT_PREFILL_STEP_MS, self.live) / 1e3,
            cached_tokens=self._prefill_cached.get(beat.worker_id, 0),
        )

    def _decode_side(self, beat: Heartbeat, prefill_prior: float) -> DecodeSide:
        c = beat.path_calibration or PathCalibration()
        return DecodeSide(
            worker_id=beat.worker_id,
            batch=beat.running,
            step_s=_pick(c.decode_step_ms, DEFAULT_DECODE_STEP_MS, self.live) / 1e3,
            prefill_tokens_per_s=_pick(c.prefill_tokens_per_s, prefill_prior, self.live),
            queued_tokens=self._decode_load.queue(beat.worker_id, beat.waiting_tokens),
            recent_local_tokens=self._recent_local_share,
        )
