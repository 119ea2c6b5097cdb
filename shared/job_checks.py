"""What a worker checks in a job before its engine sees it: anything that would fail inside the model or the
sampler on the engine thread (where an exception stops the engine for every request) is refused here.

The gateway already refuses these for its clients (services/gateway/prepare.py); these checks are for what
reaches a job subject by any other way — a bug, another tool, a hand-written message — and for workers
configured differently from the gateway (a shorter max_model_len). Pure functions: no NATS, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from shared.messages import TOKENS, DecodeJob, Job, PrefillJob, Sampling
from shared.sampling_spec import SAMPLING_FIELDS

MAX_REQUEST_ID = 256  # characters: ids name log lines, spans and Redis keys
MAX_CHOICES = 128  # choices of one job (n): a gateway allows fewer (its max_n setting)


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
    problem = siblings_problem(job)
    if problem is not None:
        return Refusal(problem, reply=False)
    for outputs in [job.output_token_ids, *(s.output_token_ids for s in job.siblings)]:
        problem = job_problem(job.prompt_token_ids, job.sampling, vocab_size, max_model_len, outputs)
        if problem is not None:
            return Refusal(problem, reply=True)
    return None


def siblings_problem(job: PrefillJob | DecodeJob) -> str | None:
    """Why a job's other choices (n > 1) cannot run, or None: too many, or an id or subject that is not sound
    (where their tokens would go is part of what is wrong: no answer is sent)."""
    if len(job.siblings) >= MAX_CHOICES:
        return f"a job has at most {MAX_CHOICES} choices, got {len(job.siblings) + 1}"
    ids = {job.request_id, *(s.request_id for s in job.siblings)}
    if len(ids) != len(job.siblings) + 1:
        return "a job's choices need distinct request ids"
    for s in job.siblings:
        problem = request_id_problem(s.request_id) or reply_subject_problem(s.reply_subject)
        if problem is not None:
            return f"sibling {s.request_id[:80]!r}: {problem}"
    return None


def reply_subject_problem(subject: str) -> str | None:
    """Why token events cannot be sent to `subject`, or None when it is a token subject. Anything else (a
    wildcard, a job or cancel subject, an empty string) would publish where no one listens for token events, or
    into another service's input."""
    if not TOKENS.matches(subject):
        return f"reply_subject {subject[:80]!r} is not a token subject pd.tokens.<gateway>.<request>"
    return None


def sampling_problem(sampling: Sampling, vocab_size: int) -> str | None:
    """Why the engine cannot sample with these parameters, or None: the ranges shared/sampling_spec.py declares,
    checked on a struct built in a process (decoding checks them on one from the wire), and stop ids inside the
    vocabulary."""
    for field in SAMPLING_FIELDS:
        problem = field.problem(getattr(sampling, field.name))
        if problem is not None:
            return problem
    return _token_ids_problem(sampling.stop_token_ids, "stop_token_ids", vocab_size) or _token_ids_problem(
        list(sampling.logit_bias), "logit_bias", vocab_size
    )


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
    if output_token_ids and sampling.max_tokens < 1:  # 0 scores a prompt; a job with tokens goes on generating
        return f"max_tokens must be at least 1 for a job that carries output tokens, got {sampling.max_tokens}"
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


def undecodable_job_refusal(data: bytes, kind: type[Job]) -> tuple[Job, Refusal] | None:
    """A job whose sampling is out of the ranges the wire declares (e.g. a temperature of -1) fails to decode as
    `kind`. When that is all that is wrong with it and it says where to answer, this is the refusal to send there,
    with the job as it would be with a stand-in sampling (its request id, attempt and reply subject are real).
    None for anything else (wrong types, missing fields: malformed, nothing to answer)."""
    try:
        fields = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    sampling = fields.get("sampling") if isinstance(fields, dict) else None
    if not isinstance(sampling, dict):
        return None
    problem = next((p for f in SAMPLING_FIELDS if (p := f.problem(sampling.get(f.name)))), None)
    if problem is None:
        return None
    try:  # everything but the sampling must be sound
        job = msgspec.convert(fields | {"sampling": {"max_tokens": 1}}, kind)
    except msgspec.ValidationError:
        return None
    if request_id_problem(job.request_id) or reply_subject_problem(job.reply_subject):
        return None
    return job, Refusal(problem, reply=True)
