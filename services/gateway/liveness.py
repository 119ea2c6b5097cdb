"""Which workers are alive, from their heartbeats (`pd.hb.<role>.<worker>`, about one a second).

A worker is live while its last heartbeat is younger than `ttl_s`. A model can be served when a live
mixed worker serves it, or a live prefill worker and a live decode worker both do; a draining worker
(shutting down: finishes what it has, takes nothing new) counts for neither. Its decode KV capacity
(admission's bound) is what the live decode and mixed workers' heartbeats report. Pure state: the caller
passes the clock, so tests need no sleeping.
"""

from __future__ import annotations

from collections import Counter

from shared.messages import Heartbeat, Role, subject_token

_HOLDS_DECODE_KV = (Role.DECODE, Role.MIXED)


class WorkerTable:
    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, Heartbeat]] = {}  # worker id → (monotonic time, last beat)

    def record(self, beat: Heartbeat, now: float) -> None:
        self._seen[beat.worker_id] = (now, beat)

    def beat(self, worker_id: str) -> Heartbeat | None:
        """The worker's last heartbeat (live or not yet forgotten); None if never heard."""
        entry = self._seen.get(worker_id)
        return None if entry is None else entry[1]

    def last_seen(self, worker_id: str) -> float | None:
        """When the worker's last heartbeat arrived (the caller's clock); None if never, or forgotten."""
        entry = self._seen.get(worker_id)
        return None if entry is None else entry[0]

    def live(self, now: float) -> list[Heartbeat]:
        """Live workers; forgets the dead ones."""
        self._seen = {w: (t, b) for w, (t, b) in self._seen.items() if now - t < self.ttl_s}
        return [beat for _, beat in self._seen.values()]

    def serving(self, model: str, now: float) -> list[Heartbeat]:
        """Live workers of `model` that take new work (not draining). Workers match on the job subject's
        model token, the name both sides derive their subjects from."""
        key = subject_token(model)
        return [b for b in self.live(now) if subject_token(b.model) == key and not b.draining]

    def kv_capacity(self, model: str, now: float) -> int | None:
        """Tokens of KV in the workers that hold `model`'s decode KV (decode and mixed, not draining); None when
        none of them reports its block size (an older worker): the capacity is unknown."""
        beats = [b for b in self.serving(model, now) if b.role in _HOLDS_DECODE_KV and b.block_size > 0]
        return sum(b.total_blocks * b.block_size for b in beats) if beats else None

    def can_serve(self, model: str, now: float) -> tuple[bool, str]:
        """(True, summary) or (False, what is missing)."""
        counts = Counter(b.role for b in self.serving(model, now))  # a role with no live worker counts 0
        summary = ", ".join(f"{counts[role]} {role}" for role in Role if counts[role])
        if counts[Role.MIXED] or (counts[Role.PREFILL] and counts[Role.DECODE]):
            return True, f"live workers for {model}: {summary}"
        if not counts:
            key = subject_token(model)
            draining = sum(b.draining for b in self.live(now) if subject_token(b.model) == key)
            if draining:
                return False, f"every live worker for model {model!r} is draining ({draining} shutting down)"
            return False, f"no live worker serves model {model!r}"
        missing = Role.DECODE if counts[Role.PREFILL] else Role.PREFILL
        return False, f"no live {missing} worker for model {model!r} (live: {summary})"
