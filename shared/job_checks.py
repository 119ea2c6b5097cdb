"""What a worker checks in a job before its engine sees it: anything that would fail inside the model or the
sampler on the engine thread (where an exception stops the engine for every request) is refused here.

The gateway already refuses these for its clients (services/gateway/prepare.py); these checks are for what
reaches a job subject by any other way — a bug, another tool, a hand-written message — and for workers
configured differently from the gateway (a shorter max_model_len). Pure functions: no NATS, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.messages import TOKENS, DecodeJob, PrefillJob, Sampling

MAX_TEMPERATURE = 100.0  # as shared.engine.sampling.SamplingParams
MAX_REQUEST_ID = 256  # characters: ids name log lines, spans and Redis keys


@dataclass(frozen=True)
class Refusal:
    reason: str
    reply: bool  # an error event can go back to the job's reply subject


def job_refusal(job: PrefillJob | DecodeJob, vocab_size: int, max_model_len: int) -> Refusal | None:
    """Why a decoded job must not reach the engine, or None: its request id, where its tokens would go, its
    tokens and sampling parameters."""
    problem = request_id_problem(job.request_id) or reply_subject_problem(job.reply_subject)
    if problem is not None:
        return Refusal(problem, reply=False)
    outputs = job.output_token_ids
    problem = job_problem(job.prompt_token_ids, job.sampling, vocab_size, max_model_len, outputs)
    return None if problem is None else Refusal(problem, reply=True)


def reply_subject_problem(subject: str) -> str | None:
    """Why token events cannot be sent to `subject`, or None when it is a token subject. Anything else (a
    wildcard, a job or cancel subject, an empty string) would publish where no one listens for token events, or
    into another service's input."""
    if not TOKENS.matches(subject):
        return f"reply_subject {subject[:80]!r} is not a token subject pd.tokens.<gateway>.<request>"
    return None


def sampling_problem(sampling: Sampling, vocab_size: int) -> str | None:
    """Why the engine cannot sample with these parameters, or None (the ranges of SamplingParams, and the
    values that would fail inside the sampler)."""
    if sampling.max_tokens < 1:
        return f"max_tokens must be at least 1, got {sampling.max_tokens}"
    t = sampling.temperature
    if not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
        return f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}"
    if not (math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0):
        return f"top_p must be in (0, 1], got {sampling.top_p}"
    if sampling.top_k is not None and sampling.top_k < 1:
        return f"top_k must be at least 1 (or null for off), got {sampling.top_k}"
    return _token_ids_problem(sampling.stop_token_ids, "stop_token_ids", vocab_size)


def job_problem(
    prompt_token_ids: Sequence[int],
    sampling: Sampling,
    vocab_size: int,
    max_model_len: int,
    output_token_ids: Sequence[int] = (),
) -> str | None:
    """Why a job cannot run in an engine of this vocabulary and context length, or None when it can.
    `output_token_ids`: tokens already sampled elsewhere (a decode job), fed to the model as well."""
    if not prompt_token_ids:
        return "the prompt is empty"
    problem = _token_ids_problem(prompt_token_ids, "prompt_token_ids", vocab_size) or _token_ids_problem(
        output_token_ids, "output_token_ids", vocab_size
    )
    if problem is not None:
        return problem
    tokens = len(prompt_token_ids) + len(output_token_ids)
    if tokens >= max_model_len:
        return (
            f"the prompt has {tokens} tokens; max_model_len is {max_model_len} and at least one token must be generated"
        )
    return sampling_problem(sampling, vocab_size)


def request_id_problem(request_id: str) -> str | None:
    if not 0 < len(request_id) <= MAX_REQUEST_ID:
        return f"request_id must have 1 to {MAX_REQUEST_ID} characters, got {len(request_id)}"
    return None


def _token_ids_problem(ids: Sequence[int], name: str, vocab_size: int) -> str | None:
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            return f"{name}[{position}] = {token} is outside the vocabulary [0, {vocab_size})"
    return None
