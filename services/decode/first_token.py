"""Admission stage 3, token 0 of a layer-streamed job: who emits a request's first token is decided once, by the
prefill worker's hand-on, and carried by the decode job (`kv_streamed`): a job handed on before its first token
existed carries none, the pull's trailer brings it (StreamedKv.first_token), and the decode worker emits it (and
counts it) before decoding on; every other job carries its first token, which the prefill worker emitted. When
a streamed job's pull fails, the decode worker recomputes and samples token 0 itself: the client sees one."""

from __future__ import annotations

import msgspec

from shared.engine.engine import Engine
from shared.engine.request import FinishReason
from shared.messages import DecodeJob


def owes_first_token(job: DecodeJob) -> bool:
    """Whether this job's first token is still to be emitted by the decode worker (the one place that asks)."""
    return job.kv_streamed


def with_first_token(job: DecodeJob, token: int) -> DecodeJob:
    """The job as if it had been handed on after its first token (what is imported and decoded on)."""
    return msgspec.structs.replace(job, output_token_ids=[*job.output_token_ids, token])


def first_token_end(engine: Engine, job: DecodeJob, outputs: list[int]) -> FinishReason | None:
    """Whether a layer-streamed job's first token (the last of `outputs`) ends it, as the prefill engine's
    scheduler decided (Scheduler._finish_reason): a stop token or EOS, max_tokens, or the model's length."""
    s, token, scheduler = job.sampling, outputs[-1], engine.scheduler
    if token in s.stop_token_ids or (not s.ignore_eos and token in scheduler.eos_token_ids):
        return FinishReason.STOP
    if len(outputs) >= s.max_tokens or len(job.prompt_token_ids) + len(outputs) >= engine.max_model_len:
        return FinishReason.LENGTH
    return None
