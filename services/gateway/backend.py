"""What the gateway needs from the serving plane, as a protocol: the HTTP layer never sees NATS.

`NatsBackend` (nats_backend.py) is the real one; tests pass an in-process fake. A request's life
against a backend: `open(job)` registers it and dispatches it, the returned stream yields `Update`s
(new tokens, in output order, never repeated; the last one carries `finish_reason`), `cancel(id)`
stops it upstream, `aclose()` on the stream forgets it locally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import msgspec

from shared.choices import choice_request_id, choice_seed
from shared.messages import Logprob, RequestStat, Sampling


class BackendUnavailable(Exception):
    """No worker can take the request now (nothing live, NATS down, publish failed): HTTP 503."""


class Overloaded(Exception):
    """The workers are busy past the admission bounds (admission.py): HTTP 429 with `Retry-After`.
    `reason` says which bound ("queue" | "kv" | "ttft_slo"), for the rejection counter."""

    def __init__(self, message: str, retry_after_s: int, reason: str = "queue") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(1, int(retry_after_s))
        self.reason = reason


@dataclass(frozen=True)
class GenerationJob:
    request_id: str  # unique per gateway and safe as a NATS subject token
    model: str  # the served model name
    prompt_token_ids: list[int]
    sampling: Sampling
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent of the request's span
    n: int = 1  # choices of the prompt (open_choices): each a request of its own on the wire, seeded seed + i
    # what the prompt's prefix-cache hashes are rooted in besides the model: tenant and request salt
    # (shared/prefix_hash.py request_salt); requests with different salts share no cached blocks
    cache_salt: str = ""
    cache_key: str | None = None  # prompt_cache_key: requests with one key prefer one prefill worker


@dataclass(frozen=True)
class Update:
    """Tokens at the next output positions. The final update has `finish_reason` set:
    "stop" | "length" (normal ends), "error" | "abort" (with `error`; `status` = the HTTP status the
    gateway answers with when nothing was streamed yet, e.g. 504 for a timeout)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500
    logprobs: list[Logprob] = field(default_factory=list)  # one per token_ids entry when the request asked
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # prompt positions 1.., on one update at most
    cached_tokens: int = 0  # prompt tokens served from a worker's prefix cache (the first update says)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        return self.finish_reason in ("error", "abort")


class RequestStream(Protocol):
    """The updates of one request. Iteration ends after the final update; the backend enforces its
    own deadlines (a stalled request ends with a failed update, never hangs)."""

    def __aiter__(self) -> AsyncIterator[Update]: ...

    async def __anext__(self) -> Update: ...

    async def aclose(self) -> None:
        """Stop listening for this request (idempotent). Does not cancel it upstream."""


@runtime_checkable  # litestar checks injected dependencies with isinstance
class GatewayBackend(Protocol):
    async def open(self, job: GenerationJob) -> RequestStream:
        """Register the request's listener, then dispatch it (subscribe before dispatch, so no token
        is missed). Raises BackendUnavailable when it cannot be dispatched, Overloaded when admission
        refuses it."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Ask every worker to drop the request and free its KV. Best effort, idempotent, never raises."""
        ...

    async def readiness(self) -> tuple[bool, str]:
        """(True, "ready") when requests can be served now, else (False, why not)."""
        ...

    async def close(self) -> None:
        """Release connections; open streams end."""
        ...


@runtime_checkable
class GroupBackend(Protocol):
    """A backend that dispatches the n choices of one prompt together (NatsBackend: one prefill, one KV hand-off)."""

    async def open_group(self, job: GenerationJob) -> list[RequestStream]:
        """One stream per choice (`choice_requests`), every one registered before the one dispatch. Raises as open."""
        ...


@runtime_checkable
class RequestStatsSink(Protocol):
    """A backend that passes each request's arrival and end on (NatsBackend: to pd.stats.requests.<model>, what
    the SLO planner forecasts from). Never blocks and never raises: a statistic is not worth a request."""

    gateway_id: str

    def record_stat(self, stat: RequestStat) -> None: ...


def choice_requests(job: GenerationJob) -> list[GenerationJob]:
    """The job's choices as single jobs: choice i's wire request id and seed (shared/choices.py)."""
    return [
        dataclasses.replace(
            job,
            request_id=choice_request_id(job.request_id, i),
            sampling=msgspec.structs.replace(job.sampling, seed=choice_seed(job.sampling.seed, i)),
            n=1,
        )
        for i in range(job.n)
    ]


async def open_choices(backend: GatewayBackend, job: GenerationJob) -> list[RequestStream]:
    """The streams of a job's n choices, in choice order: dispatched together by a GroupBackend, else each as a
    single request (a choice equals a single request with its seed, so the answer is the same). On a failure
    the streams already opened are cancelled and closed before it propagates."""
    if isinstance(backend, GroupBackend):
        return await backend.open_group(job)
    streams: list[RequestStream] = []
    try:
        for single in choice_requests(job):
            streams.append(await backend.open(single))
    except BaseException:
        for single, stream in zip(choice_requests(job), streams, strict=False):
            await backend.cancel(single.request_id)
            await stream.aclose()
        raise
    return streams
