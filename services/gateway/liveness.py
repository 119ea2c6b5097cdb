"""Which workers are alive, from their heartbeats (`pd.hb.<role>.<worker>`, about one a second).

A worker is live while its last heartbeat is younger than `ttl_s`. A model can be served when a live
mixed worker serves it, or a live prefill worker and a live decode worker both do. Pure state: the
caller passes the clock, so tests need no sleeping.
"""

from __future__ import annotations

from shared.messages import Heartbeat, Role, subject_token


class WorkerTable:
    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, Heartbeat]] = {}  # worker id → (monotonic time, last beat)

    def record(self, beat: Heartbeat, now: float) -> None:
        self._seen[beat.worker_id] = (now, beat)

    def live(self, now: float) -> list[Heartbeat]:
        """Live workers; forgets the dead ones."""
        self._seen = {w: (t, b) for w, (t, b) in self._seen.items() if now - t < self.ttl_s}
        return [beat for _, beat in self._seen.values()]

    def can_serve(self, model: str, now: float) -> tuple[bool, str]:
        """(True, summary) or (False, what is missing). Workers match on the job subject's model token,
        the name both sides derive their subjects from."""
        key = subject_token(model)
        roles = [b.role for b in self.live(now) if subject_token(b.model) == key]
        counts = {r.value: roles.count(r.value) for r in Role}
        summary = ", ".join(f"{n} {role}" for role, n in counts.items() if n)
        if counts[Role.MIXED.value] or (counts[Role.PREFILL.value] and counts[Role.DECODE.value]):
            return True, f"live workers for {model}: {summary}"
        if not roles:
            return False, f"no live worker serves model {model!r}"
        missing = "decode" if counts[Role.PREFILL.value] else "prefill"
        return False, f"no live {missing} worker for model {model!r} (live: {summary})"
