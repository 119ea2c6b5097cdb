"""Every message that crosses a service boundary on NATS, and every subject name. Nothing else names them.

Payloads are msgspec structs encoded as JSON (small, typed, readable with `nats sub`). Token ids travel
as lists of ints; KV tensors never travel on NATS (they move over the KV transfer plane).

Subjects:
    pd.jobs.prefill.<model>           JetStream work queue: prompts waiting for a prefill worker
    pd.jobs.decode.<model>            JetStream work queue: prefilled requests waiting for a decode worker
    pd.tokens.<gateway>.<request>     core NATS: token events for one request, to the gateway that owns it
    pd.cancel.<request>               JetStream (stream PD_CANCELS, kept CANCEL_RETENTION_S): stop a request
                                      everywhere (client went away, request moved on)
    pd.hb.<role>.<worker>             core NATS: worker heartbeats (readiness, load)
"""

from __future__ import annotations

import logging
import re
from enum import Enum
from typing import Annotated

import msgspec

_log = logging.getLogger(__name__)

JOBS_STREAM = "PD_JOBS"
JOBS_SUBJECTS = "pd.jobs.>"
CANCELS_STREAM = "PD_CANCELS"
CANCEL_RETENTION_S = 600.0  # as long as workers remember a cancel: an older one would be forgotten anyway
CANCEL_WILDCARD = "pd.cancel.*"
HEARTBEAT_WILDCARD = "pd.hb.>"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(name: str) -> str:
    """A model or worker name made safe for one NATS subject token (no dots, spaces or wildcards)."""
    return _UNSAFE.sub("_", name) or "_"


def prefill_subject(model: str) -> str:
    return f"pd.jobs.prefill.{subject_token(model)}"


def decode_subject(model: str) -> str:
    return f"pd.jobs.decode.{subject_token(model)}"


def token_subject(gateway_id: str, request_id: str) -> str:
    return f"pd.tokens.{subject_token(gateway_id)}.{subject_token(request_id)}"


def token_wildcard(gateway_id: str) -> str:
    """Every token subject of one gateway (it subscribes once and routes by request id)."""
    return f"pd.tokens.{subject_token(gateway_id)}.>"


def cancel_subject(request_id: str) -> str:
    return f"pd.cancel.{subject_token(request_id)}"


def heartbeat_subject(role: str, worker_id: str) -> str:
    return f"pd.hb.{role}.{subject_token(worker_id)}"


def attempt_key(request_id: str, attempt: int) -> str:
    """What names one attempt of a request inside a worker (engine request, held KV, Redis entry, KV pull):
    two attempts of one request may meet on one worker (a hung worker resumes after its request moved on)."""
    return request_id if attempt == 0 else f"{request_id}~{attempt}"


class Role(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class Sampling(msgspec.Struct, frozen=True):
    """The wire form of shared.engine.sampling.SamplingParams (validated by the gateway)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class PrefillJob(msgspec.Struct, frozen=True):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling
    reply_subject: str  # where token events go
    attempt: int = 0  # bumped on every re-dispatch; events of older attempts are dropped
    created_at: float = 0.0  # gateway's wall clock when the request arrived (queue-time metrics)
    # Tokens already delivered (a request moved here after its worker died): prompt + these are recomputed and
    # generation resumes after them; the first token this job produces is at position len(output_token_ids).
    output_token_ids: list[int] = []

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)


class DecodeJob(msgspec.Struct, frozen=True):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled so far (the first token, or more after a migration)
    sampling: Sampling
    reply_subject: str
    attempt: int = 0
    prefill_worker: str | None = None  # who holds the KV; None = nothing to pull, recompute
    created_at: float = 0.0

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)


# What a token event may carry (the gateway drops anything else as malformed): positions and attempts are never
# negative, and token ids fit the u32 every tokenizer uses (decoding a negative id fails in the detokenizer).
_Count = Annotated[int, msgspec.Meta(ge=0)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class TokenEvent(msgspec.Struct, frozen=True):
    """New tokens of a request, or its end. `seq` is the output position of token_ids[0] (0 = the first
    generated token), whatever the attempt: the gateway delivers positions in order, drops positions it
    already delivered (duplicates after a re-dispatch) and holds back early ones (two publishers: the
    prefill worker sends position 0, a decode worker the rest). Events of an attempt older than the
    newest one seen are stale and dropped. A final event carries finish_reason (and no or more tokens).

    Events also say who is responsible for the request's progress, so that the gateway can move it when
    that worker dies: a worker that takes a job says so at once (an event with no tokens, seq = the next
    position); every event of `worker_id` makes it the holder, until one with `queued` says the request
    now waits in a job queue (the prefill worker published the decode job)."""

    request_id: str
    attempt: _Count
    seq: _Count
    token_ids: list[_TokenId]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    worker_id: str = ""
    status: int = 500  # with an error: the HTTP status it means (400 = the request itself was refused)
    queued: bool = False  # after this event no worker holds the request: it waits in a job queue


class Cancel(msgspec.Struct, frozen=True):
    request_id: str
    up_to_attempt: int | None = None  # drop attempts up to this one (the request moved on); None = all

    def covers(self, attempt: int) -> bool:
        return self.up_to_attempt is None or attempt <= self.up_to_attempt


class Heartbeat(msgspec.Struct, frozen=True):
    worker_id: str
    role: str
    model: str
    rpc_address: str | None  # prefill workers: where decode workers pull KV from
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    # cumulative tokens the engine computed by phase: a decode worker's prefill_tokens stays 0 when every
    # request's KV was pulled (recomputations show up here)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    held_kv: int = 0  # prefill workers: requests whose KV waits for a pull
    integrity_error: str | None = None  # Engine.check_integrity() failure; None = block accounting is sound
    block_size: int = 0  # tokens per KV block: total_blocks * block_size = the KV capacity in tokens
    draining: bool = False  # shutting down: finishes what it has, takes nothing new


_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: type[msgspec.Struct]):  # -> kind
    """Raises msgspec.ValidationError / DecodeError on malformed input."""
    try:
        return msgspec.json.decode(data, type=kind)
    except RecursionError as exc:  # msgspec's guard against arrays / objects nested thousands deep
        raise msgspec.DecodeError("JSON is nested too deeply") from exc


def decode_or_drop(data: bytes, kind: type[msgspec.Struct], subject: str):  # -> kind | None
    """`decode`, or None after logging why: a malformed message is dropped, never fatal to its reader."""
    try:
        return decode(data, kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _log.warning("dropping malformed %s on %s: %s", kind.__name__, subject, exc)
        return None
