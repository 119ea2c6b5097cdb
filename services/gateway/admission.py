"""Admission control: take one more request now, or answer 429 with a `Retry-After`.

A request is admitted only while both bounds hold over what this gateway has in flight (its open request
streams, the new request not yet among them):
  - queue depth: the requests dispatched and still without their first token are fewer than
    `max_pending_requests` (past it, new work would only lengthen every queued request's TTFT);
  - KV: the tokens the in-flight requests occupy, plus the new prompt, stay within `kv_overcommit` × the KV
    capacity of the live workers that hold decode KV (decode and mixed; draining ones count for nothing).
    Past it, decode workers would preempt and recompute, or refuse jobs that then sit in the queue.

A request alone is never refused for KV: with nothing in flight, waiting cannot make room for it.

A third bound, off unless `admission_ttft_refuse` is set, follows the TTFT target once the request's prefill path
is chosen (prefill_path.py, which already takes the local path where that meets the target and the remote one
does not): the request is refused when its predicted TTFT on that path exceeds the limit
(`admission_ttft_factor` × `ttft_slo_ms`) and the backlog ahead of it is why, i.e. the same prompt would meet the
limit behind no queued prompt. A prompt that misses even on an idle worker is admitted: waiting cannot help it.
Its `Retry-After` is the predicted time until the backlog has drained enough for the limit to hold: the queue
shrinks by a second of work per second, so predicted TTFT - limit.

`Retry-After` comes from the rate at which in-flight requests recently left (finished, failed or were
cancelled): the number that must leave before the refused request fits, divided by that rate, in whole
seconds within [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]. The pure part (`Admission`) takes the clock and the
in-flight snapshot as arguments; `admit` is the NatsBackend's hook that feeds it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from services.gateway.backend import GenerationJob, Overloaded
from services.gateway.liveness import WorkerTable
from services.gateway.prefill_path import PathChoice
from shared.telemetry import metrics

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_UNKNOWN_S = 5  # no request left within the window yet (a fresh gateway hit by a burst)
RATE_WINDOW_S = 30.0  # departures older than this do not count towards the rate


class InFlight(Protocol):
    """What admission reads of one open request (RequestUpdates in the NatsBackend). Read-only properties: an
    implementation may hold them as attributes or compute them."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def delivered(self) -> int: ...  # output tokens delivered to the client so far

    @property
    def first_token_seen(self) -> bool: ...


@dataclass(frozen=True)
class Load:
    requests: int
    pending: int  # without their first token yet
    kv_tokens: int  # estimated KV the requests occupy, in tokens

    @classmethod
    def of(cls, in_flight: Iterable[InFlight]) -> Load:
        requests = pending = kv_tokens = 0
        for r in in_flight:
            requests += 1
            pending += not r.first_token_seen
            # An estimate: a worker holds prompt + every token generated so far; the gateway knows the tokens
            # it delivered, which trail the worker's by the events still in flight (a few tokens at most).
            # Requests still queued for prefill hold nothing yet but will: counting them keeps the bound honest.
            kv_tokens += r.prompt_tokens + r.delivered
        return cls(requests, pending, kv_tokens)


def ttft_overload(choice: PathChoice, limit_s: float) -> Overloaded | None:
    """The refusal of a request whose first token, on the path chosen for it, is predicted past `limit_s` because
    of the backlog ahead of it (see the module); None: admit it."""
    chosen = choice.chosen
    if chosen is None or chosen.ttft_s <= limit_s:
        return None
    if chosen.ttft_s - chosen.queue_s > limit_s:
        return None  # it misses behind no queue too: refusing it now would refuse it forever
    retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(chosen.ttft_s - limit_s)))
    return Overloaded(
        f"the server cannot meet the time-to-first-token target now: this request's first token is predicted in "
        f"{chosen.ttft_s:.1f} s on the {choice.path} prefill path, {chosen.queue_s:.1f} s of it behind queued "
        f"prompts, over the limit of {limit_s:.1f} s (ttft_slo_ms × admission_ttft_factor); retry in {retry} s",
        retry,
        reason="ttft_slo",
    )


class Admission:
    """The bounds and the departure rate behind Retry-After. Not thread-safe: one event loop calls it."""

    def __init__(
        self,
        max_pending_requests: int,
        kv_overcommit: float,
        window_s: float = RATE_WINDOW_S,
        ttft_limit_s: float | None = None,
    ) -> None:
        """ttft_limit_s: the TTFT bound's limit (see the module); None = that bound is off."""
        if max_pending_requests < 1 or kv_overcommit <= 0:
            raise ValueError("max_pending_requests must be >= 1 and kv_overcommit positive")
        if ttft_limit_s is not None and ttft_limit_s <= 0:
            raise ValueError("the TTFT limit must be positive")
        self.max_pending_requests = max_pending_requests
        self.kv_overcommit = kv_overcommit
        self.window_s = window_s
        self.ttft_limit_s = ttft_limit_s
        self._known: set[str] = set()  # request ids in flight at the last check, plus those admitted by it
        self._departures: deque[tuple[float, int]] = deque()  # (when noticed, how many), oldest first
        self._observing_since: float | None = None

    def check(
        self,
        request_id: str,
        prompt_tokens: int,
        in_flight: Mapping[str, InFlight],
        kv_capacity: int | None,
        now: float,
    ) -> None:
        """Admit `request_id` (return) or raise Overloaded. `kv_capacity`: tokens of decode KV in the live workers;
        None = unknown (no worker reports it), and then only the queue bound applies."""
        self._note_departures(in_flight.keys(), now)
        load = Load.of(in_flight.values())
        if load.pending >= self.max_pending_requests:
            must_leave = load.pending - self.max_pending_requests + 1
            retry = self.retry_after_s(must_leave, now)
            raise Overloaded(
                f"the server is at capacity: {load.pending} requests are waiting for their first token "
                f"(limit {self.max_pending_requests}); retry in {retry} s",
                retry,
                reason="queue",
            )
        if kv_capacity is not None and load.requests:
            limit = int(self.kv_overcommit * kv_capacity)
            excess = load.kv_tokens + prompt_tokens - limit
            if excess > 0:
                # requests that must leave to free `excess` tokens, each holding the in-flight mean
                must_leave = math.ceil(excess / max(1.0, load.kv_tokens / load.requests))
                retry = self.retry_after_s(must_leave, now)
                raise Overloaded(
                    f"the server is at capacity: in-flight requests hold about {load.kv_tokens} tokens of KV and "
                    f"this prompt needs {prompt_tokens} more, over the limit of {limit} (the live decode workers' "
                    f"{kv_capacity} tokens × kv_overcommit {self.kv_overcommit:g}); retry in {retry} s",
                    retry,
                    reason="kv",
                )
        self._known.add(request_id)

    def departure_rate(self, now: float) -> float | None:
        """Requests that left per second over the window; None before any left or within a second of starting."""
        while self._departures and self._departures[0][0] <= now - self.window_s:
            self._departures.popleft()
        if not self._departures or self._observing_since is None:
            return None
        span = min(self.window_s, now - self._observing_since)
        if span < 1.0:
            return None
        return sum(n for _, n in self._departures) / span

    def retry_after_s(self, must_leave: int, now: float) -> int:
        """Whole seconds until `must_leave` more requests have left at the recent rate, bounded."""
        rate = self.departure_rate(now)
        if rate is None:
            return RETRY_AFTER_UNKNOWN_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(must_leave / rate)))

    def _note_departures(self, current: Iterable[str], now: float) -> None:
        """Requests known at the last check and gone now have left (noticed now, not when they left: under load,
        when Retry-After matters, checks come often)."""
        if self._observing_since is None:
            self._observing_since = now
        current = set(current)
        if gone := len(self._known - current):
            self._departures.append((now, gone))
        self._known = current

    def admit(self, workers: WorkerTable, in_flight: Mapping[str, InFlight], job: GenerationJob) -> None:
        """The NatsBackend's hook, called before it registers and dispatches `job`: returns, or raises Overloaded
        (counted in pdserve:requests_rejected_total by reason)."""
        now = time.monotonic()
        try:
            # n choices: n sequences, each holding the prompt (shared in the workers: a bound that errs safe)
            tokens = len(job.prompt_token_ids) * job.n
            self.check(job.request_id, tokens, in_flight, workers.kv_capacity(job.model, now), now)
        except Overloaded as exc:
            metrics.REQUESTS_REJECTED.labels(job.model, "gateway", exc.reason).inc()
            raise

    def admit_path(self, choice: PathChoice, job: GenerationJob) -> None:
        """The NatsBackend's hook once `job`'s prefill path is chosen (after `admit`): returns, or raises Overloaded
        (reason ttft_slo, counted) where the TTFT bound is on and refuses it."""
        if self.ttft_limit_s is None:
            return
        refusal = ttft_overload(choice, self.ttft_limit_s)
        if refusal is None:
            return
        self._known.discard(job.request_id)  # admitted by `check`, but never in flight: not a departure later
        metrics.REQUESTS_REJECTED.labels(job.model, "gateway", refusal.reason).inc()
        raise refusal
