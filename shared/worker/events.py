"""Every token event the worker runtime sends to the gateway is built here (and nowhere else), each as the struct of
its kind (shared/messages.py: the TokenEvent union)."""

from __future__ import annotations

from shared.engine.engine import RequestOutput
from shared.engine.logprobs import TokenLogprobs
from shared.engine.request import FinishReason as EngineFinishReason
from shared.messages import (
    DecodeJob,
    FailedEvent,
    FinishedEvent,
    FinishReason,
    Logprob,
    PrefillJob,
    QueuedEvent,
    TakenEvent,
    TokensEvent,
)


def wire_finish_reason(reason: EngineFinishReason | None) -> FinishReason:
    """The engine's reason as the wire says it; a finished output without one ran out of length."""
    return FinishReason(reason.value) if reason is not None else FinishReason.LENGTH


def wire_logprobs(logprobs: list[TokenLogprobs] | None) -> list[Logprob]:
    """The engine's logprobs as the wire carries them (none when the request did not ask)."""
    return [Logprob(lp.logprob, list(lp.top_ids), list(lp.top_logprobs)) for lp in logprobs or ()]


def token_event(request_id: str, attempt: int, out: RequestOutput, worker_id: str) -> TokensEvent | FinishedEvent:
    """The wire event of one engine output: its new tokens (with their logprobs, and the prompt's on the first
    output, when asked), and the end when it finished."""
    seq, tokens, prompt_tokens = (
        out.num_output_tokens - len(out.new_token_ids),
        out.new_token_ids,
        out.num_prompt_tokens,
    )
    lps, prompt_lps = wire_logprobs(out.logprobs), wire_logprobs(out.prompt_logprobs)
    cached = _cached_tokens(seq, out)
    output = (request_id, attempt, seq, tokens, worker_id, prompt_tokens, lps, prompt_lps, cached)
    if out.finished:
        return FinishedEvent(*output, finish_reason=wire_finish_reason(out.finish_reason))
    return TokensEvent(*output)


def _cached_tokens(seq: int, out: RequestOutput) -> int:
    """The prompt tokens the engine's prefix cache supplied, on the event of output position 0 only: the worker
    that computed the prompt for the client's first token says it (usage.prompt_tokens_details); a decode worker
    importing the KV, or a moved request's recompute, does not."""
    return out.num_cached_tokens if seq == 0 else 0


def error_event(job: PrefillJob | DecodeJob, message: str, worker_id: str, status: int = 400) -> FailedEvent:
    """The request was refused (by default as a client mistake the gateway could not see, e.g. a worker
    with a shorter max_model_len)."""
    return FailedEvent(job.request_id, job.attempt, message, status, worker_id)


def announce_event(job: PrefillJob | DecodeJob, worker_id: str) -> TakenEvent:
    """This worker holds the request now (the gateway watches its heartbeats from here on). Its position is where
    the stage begins (the gateway keeps one taker per stage): a layer-streamed decode job's stage is still the one
    after the first token, although this worker emits that token too."""
    streamed = isinstance(job, DecodeJob) and job.kv_streamed
    return TakenEvent(job.request_id, job.attempt, len(job.output_token_ids) + streamed, worker_id)


def first_token_event(
    job: PrefillJob,
    out: RequestOutput,
    finished: bool,
    reason: EngineFinishReason | None,
    worker_id: str,
) -> TokensEvent | FinishedEvent:
    """A prefill worker's one sampled token (none when max_tokens is 0: the prompt was only scored), at the
    position after the tokens the job already carries, with its logprobs and the prompt's when asked; the
    request's end too when that token finished it."""
    seq, tokens = len(job.output_token_ids), out.new_token_ids[:1]
    lps, prompt_lps = wire_logprobs(out.logprobs), wire_logprobs(out.prompt_logprobs)
    cached = _cached_tokens(seq, out)
    output = (job.request_id, job.attempt, seq, tokens, worker_id, out.num_prompt_tokens, lps, prompt_lps, cached)
    if finished:
        return FinishedEvent(*output, finish_reason=wire_finish_reason(reason))
    return TokensEvent(*output)


def queued_event(job: PrefillJob, worker_id: str, streamed: bool = False) -> QueuedEvent:
    """The decode job is published: no worker holds the request until a decode worker takes it (streamed: it was
    published before the first token, which the decode worker emits); or, routed to a decode worker's own queue
    (job.decode_worker), that worker holds it from now."""
    seq = len(job.output_token_ids) + (not streamed)
    return QueuedEvent(job.request_id, job.attempt, seq, worker_id, routed_to=job.decode_worker)


def streamed_first_token_event(
    job: DecodeJob, token: int, reason: EngineFinishReason | None, worker_id: str
) -> TokensEvent | FinishedEvent:
    """A decode worker's event for the first token of a layer-streamed job (the pull's trailer: sampled by the
    prefill worker, which did not emit it), the request's end too when that token finished it."""
    seq, prompt_tokens = len(job.output_token_ids), len(job.prompt_token_ids)
    output = (job.request_id, job.attempt, seq, [token], worker_id, prompt_tokens)
    if reason is not None:
        return FinishedEvent(*output, finish_reason=wire_finish_reason(reason))
    return TokensEvent(*output)
