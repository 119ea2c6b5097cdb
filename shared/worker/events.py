"""Every TokenEvent the worker runtime sends to the gateway is built here (and nowhere else)."""

from __future__ import annotations

from shared.engine.engine import RequestOutput
from shared.messages import DecodeJob, PrefillJob, TokenEvent


def token_event(request_id: str, attempt: int, out: RequestOutput, worker_id: str) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        attempt=attempt,
        seq=out.num_output_tokens - len(out.new_token_ids),
        token_ids=out.new_token_ids,
        finish_reason=out.finish_reason.value if out.finished and out.finish_reason else None,
        prompt_tokens=out.num_prompt_tokens,
        worker_id=worker_id,
    )


def error_event(job: PrefillJob | DecodeJob, message: str, worker_id: str, status: int = 400) -> TokenEvent:
    """The request was refused (by default as a client mistake the gateway could not see, e.g. a worker
    with a shorter max_model_len)."""
    return TokenEvent(
        request_id=job.request_id,
        attempt=job.attempt,
        seq=0,
        token_ids=[],
        finish_reason="error",
        error=message,
        status=status,
        worker_id=worker_id,
    )


def announce_event(job: PrefillJob | DecodeJob, worker_id: str) -> TokenEvent:
    """No tokens: this worker holds the request now (the gateway watches its heartbeats from here on)."""
    seq = len(job.output_token_ids)
    return TokenEvent(job.request_id, job.attempt, seq, [], worker_id=worker_id)


def first_token_event(
    job: PrefillJob, token: int, finish_reason: str | None, prompt_tokens: int, worker_id: str
) -> TokenEvent:
    """A prefill worker's one sampled token, at the position after the tokens the job already carries."""
    return TokenEvent(
        request_id=job.request_id,
        attempt=job.attempt,
        seq=len(job.output_token_ids),
        token_ids=[token],
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        worker_id=worker_id,
    )


def queued_event(job: PrefillJob, worker_id: str) -> TokenEvent:
    """The decode job is published: no worker holds the request until a decode worker takes it."""
    return TokenEvent(job.request_id, job.attempt, len(job.output_token_ids) + 1, [], worker_id=worker_id, queued=True)
