"""Every message that crosses a service boundary on NATS, and every subject name. Nothing else names them.

Payloads are msgspec structs encoded as JSON (small, typed, readable with `nats sub`). Token ids travel
as lists of ints; KV tensors never travel on NATS (they move over the KV transfer plane).

Subjects:
    pd.jobs.prefill.<model>           JetStream work queue: prompts waiting for a prefill worker
    pd.jobs.prefill.<model>.<worker>  JetStream work queue: prompts the gateway routed to one prefill (or mixed)
                                      worker for the prefix it holds (docs/architecture.md, KV-aware routing)
    pd.jobs.decode.<model>            JetStream work queue: prefilled requests waiting for a decode worker
    pd.jobs.decode.<model>.<worker>   JetStream work queue: prefilled requests the gateway routed to one decode
                                      worker for the prompt it holds (docs/architecture.md, decode-side reuse)
    pd.tokens.<gateway>.<request>     core NATS: token events for one request, to the gateway that owns it
    pd.cancel.<request>               JetStream (stream PD_CANCELS, kept CANCEL_RETENTION_S): stop a request
                                      everywhere (client went away, request moved on)
    pd.hb.<role>.<worker>             core NATS: worker heartbeats (readiness, load)
    pd.kv.blocks.<model>.<worker>     core NATS: the prefix-cache blocks a worker stored / removed (KvBlockUpdate)
    pd.kv.snapshot.<model>            core NATS request: every worker named answers, to the reply subject, with
                                      its whole list of held blocks (KvBlockSnapshot parts)
    pd.stats.requests.<model>         core NATS: each request's arrival and end as a gateway saw them
                                      (RequestStat), what the SLO planner forecasts from (services/planner)
    pd.control.<worker>               core NATS request/reply: a signed order to one worker (RoleControl: switch
                                      role), answered with a RoleSwitchReply once done (shared/role_control/)
    pd.resend.<model>                 core NATS: a gateway asks every worker of the model for token events it
                                      lacks (ResendRequest); each worker that sent any publishes them again
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import msgspec

from shared import sampling_spec as spec
from shared.structured.spec import StructuredSpec

_log = logging.getLogger(__name__)

JOBS_STREAM = "PD_JOBS"
CANCELS_STREAM = "PD_CANCELS"
CANCEL_RETENTION_S = 600.0  # as long as workers remember a cancel: an older one would be forgotten anyway

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(name: str) -> str:
    """A model or worker name made safe for one NATS subject token (no dots, spaces or wildcards)."""
    return _UNSAFE.sub("_", name) or "_"


class Subject:
    """One subject of the grammar above, e.g. Subject("pd.tokens.{gateway}.{request}"): `make` fills every
    placeholder with a safe token, `wildcard` leaves the unnamed ones open, `matches` / `parse` read one back.
    Every subject pdserve publishes to or listens on is made by one of the templates below."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.names = tuple(re.findall(r"{(\w+)}", template))
        pattern = re.escape(template)
        for name in self.names:
            pattern = pattern.replace(re.escape(f"{{{name}}}"), f"(?P<{name}>[A-Za-z0-9_-]+)")
        self._regex = re.compile(pattern)

    def make(self, **tokens: str) -> str:
        if set(tokens) != set(self.names):
            raise ValueError(f"{self.template} needs {self.names}, got {sorted(tokens)}")
        return self.template.format(**{k: subject_token(str(v)) for k, v in tokens.items()})

    def wildcard(self, **tokens: str) -> str:
        """The subject with the given tokens filled and the rest open: `*` each, or one `>` for a trailing run."""
        parts = self.template.split(".")
        for i, part in enumerate(parts):
            if part.startswith("{"):
                name = part[1:-1]
                if name in tokens:
                    parts[i] = subject_token(str(tokens[name]))
                elif all(p.startswith("{") and p[1:-1] not in tokens for p in parts[i:]):
                    return ".".join([*parts[:i], ">"])
                else:
                    parts[i] = "*"
        return ".".join(parts)

    def matches(self, subject: str) -> bool:
        return self._regex.fullmatch(subject) is not None

    def parse(self, subject: str) -> dict[str, str] | None:
        """The tokens of a subject of this template, or None for any other subject."""
        m = self._regex.fullmatch(subject)
        return None if m is None else m.groupdict()

    def __str__(self) -> str:
        return self.template


PREFILL_JOBS = Subject("pd.jobs.prefill.{model}")
DECODE_JOBS = Subject("pd.jobs.decode.{model}")
TOKENS = Subject("pd.tokens.{gateway}.{request}")
CANCELS = Subject("pd.cancel.{request}")
HEARTBEATS = Subject("pd.hb.{role}.{worker}")
ROUTED_PREFILL_JOBS = Subject("pd.jobs.prefill.{model}.{worker}")
ROUTED_DECODE_JOBS = Subject("pd.jobs.decode.{model}.{worker}")
KV_BLOCKS = Subject("pd.kv.blocks.{model}.{worker}")
KV_SNAPSHOT_REQUESTS = Subject("pd.kv.snapshot.{model}")
REQUEST_STATS = Subject("pd.stats.requests.{model}")
CONTROL = Subject("pd.control.{worker}")
RESEND_REQUESTS = Subject("pd.resend.{model}")

JOBS_SUBJECTS = "pd.jobs.>"  # the jobs stream holds both queues
CANCEL_WILDCARD = CANCELS.wildcard()
HEARTBEAT_WILDCARD = HEARTBEATS.wildcard()


def prefill_subject(model: str) -> str:
    return PREFILL_JOBS.make(model=model)


def decode_subject(model: str) -> str:
    return DECODE_JOBS.make(model=model)


def routed_prefill_subject(model: str, worker_id: str) -> str:
    """The prefill queue of one worker: jobs routed to it for its cached prefix (its own durable consumer)."""
    return ROUTED_PREFILL_JOBS.make(model=model, worker=worker_id)


def routed_decode_subject(model: str, worker_id: str) -> str:
    """The decode queue of one worker: prefilled requests routed to it for the prompt its cache holds."""
    return ROUTED_DECODE_JOBS.make(model=model, worker=worker_id)


def handed_on_subject(model: str, decode_worker: str | None) -> str:
    """Where a prefill worker publishes a decode job: the routed decode worker's own queue, or the shared one."""
    return decode_subject(model) if decode_worker is None else routed_decode_subject(model, decode_worker)


def kv_blocks_subject(model: str, worker_id: str) -> str:
    return KV_BLOCKS.make(model=model, worker=worker_id)


def kv_blocks_wildcard(model: str) -> str:
    """Every worker's block updates for one model (a gateway subscribes once)."""
    return KV_BLOCKS.wildcard(model=model)


def kv_snapshot_subject(model: str) -> str:
    return KV_SNAPSHOT_REQUESTS.make(model=model)


def resend_subject(model: str) -> str:
    """Where a gateway asks the workers of `model` for token events again (every one of them listens)."""
    return RESEND_REQUESTS.make(model=model)


def token_subject(gateway_id: str, request_id: str) -> str:
    return TOKENS.make(gateway=gateway_id, request=request_id)


def token_wildcard(gateway_id: str) -> str:
    """Every token subject of one gateway (it subscribes once and routes by request id)."""
    return TOKENS.wildcard(gateway=gateway_id)


def cancel_subject(request_id: str) -> str:
    return CANCELS.make(request=request_id)


def request_stats_subject(model: str) -> str:
    return REQUEST_STATS.make(model=model)


def heartbeat_subject(role: str, worker_id: str) -> str:
    return HEARTBEATS.make(role=role, worker=worker_id)


def control_subject(worker_id: str) -> str:
    """Where one worker takes control orders (role switches), request/reply."""
    return CONTROL.make(worker=worker_id)


def attempt_key(request_id: str, attempt: int) -> str:
    """What names one attempt of a request inside a worker (engine request, held KV, Redis entry, KV pull):
    two attempts of one request may meet on one worker (a hung worker resumes after its request moved on)."""
    return request_id if attempt == 0 else f"{request_id}~{attempt}"


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


def range_meta(r: spec.Range | None, description: str, **extra: Any) -> msgspec.Meta:
    """A declared range (shared/sampling_spec.py) as msgspec constraints, naming only the sides it has."""
    r = r or spec.Range()
    given = (("ge", r.ge), ("gt", r.gt), ("le", r.le), ("lt", r.lt))
    bounds: dict[str, Any] = {name: value for name, value in given if value is not None}
    return msgspec.Meta(**bounds, description=description, **extra)


def _meta(field: spec.SamplingField[object], values: spec.Range | None = None) -> msgspec.Meta:
    """A field's declared range (or its values' range, for a map's values) as constraints: decoding a job enforces
    them; shared/job_checks.py words a refusal from the declaration itself."""
    return range_meta(values or field.range, field.doc)


class Sampling(msgspec.Struct, frozen=True):
    """The wire form of shared.engine.sampling.SamplingParams (validated by the gateway). Every field, its range,
    default and meaning come from shared/sampling_spec.py; the types are spelled here for the type checker
    (tests/unit/test_sampling_spec.py holds them to the declaration)."""

    max_tokens: Annotated[int, _meta(spec.MAX_TOKENS)]  # required: a job states it
    temperature: Annotated[float, _meta(spec.TEMPERATURE)] = spec.TEMPERATURE.default
    top_p: Annotated[float, _meta(spec.TOP_P)] = spec.TOP_P.default
    top_k: Annotated[int, _meta(spec.TOP_K)] | None = spec.TOP_K.default
    seed: int | None = spec.SEED.default
    stop_token_ids: list[int] = []
    ignore_eos: bool = spec.IGNORE_EOS.default
    presence_penalty: Annotated[float, _meta(spec.PRESENCE_PENALTY)] = spec.PRESENCE_PENALTY.default
    frequency_penalty: Annotated[float, _meta(spec.FREQUENCY_PENALTY)] = spec.FREQUENCY_PENALTY.default
    repetition_penalty: Annotated[float, _meta(spec.REPETITION_PENALTY)] = spec.REPETITION_PENALTY.default
    min_p: Annotated[float, _meta(spec.MIN_P)] = spec.MIN_P.default
    logit_bias: dict[int, Annotated[float, _meta(spec.LOGIT_BIAS, spec.LOGIT_BIAS.item_range)]] = {}
    logprobs: Annotated[int, _meta(spec.LOGPROBS)] | None = spec.LOGPROBS.default
    prompt_logprobs: Annotated[int, _meta(spec.PROMPT_LOGPROBS)] | None = spec.PROMPT_LOGPROBS.default
    structured: StructuredSpec | None = None  # the output must match it (validated by the gateway)


class Sibling(msgspec.Struct, frozen=True):
    """Another choice of a job's prompt (n > 1; shared/choices.py): a request of its own on the wire (its own id,
    token subject, seed), computed with the job's choice from one prefill and one KV hand-off. On a DecodeJob it
    carries the tokens it sampled so far (its first, from the prefill worker)."""

    request_id: str
    reply_subject: str
    seed: int | None = None
    output_token_ids: list[int] = []


# A request's prefix-cache salt: its tenant's id and its own cache_salt (bounded at the gateway), joined.
CacheSalt = Annotated[str, msgspec.Meta(max_length=1024)]


class HotExperts(msgspec.Struct, frozen=True, array_like=True):
    """A compact summary of expert load (decode routed by expert affinity, shared/expert_affinity.py): the top
    (sparse layer, logical expert) pairs by tokens routed, heaviest first, with their token counts. A request's
    prefill (on its hand-off) or a decode worker's recent load (in its heartbeat). A few dozen ints at most."""

    layers: list[int]
    experts: list[int]
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]

    def __post_init__(self) -> None:
        if not len(self.layers) == len(self.experts) == len(self.tokens):
            raise ValueError("hot experts: one layer, expert and token count per pair")


class AffinityCandidate(msgspec.Struct, frozen=True):
    """A decode worker the prefill worker may hand a job to by expert affinity: its id, its running requests at the
    gateway's dispatch (the tie-break) and its recent hot experts (its heartbeat's)."""

    worker_id: str
    running: int
    hot: HotExperts


class DecodeAffinity(msgspec.Struct, frozen=True):
    """The gateway's expert-affinity routing for one job (services/gateway/decode_router.py): the decode workers
    the prefill worker picks among once it knows which experts the prompt activated, and how many of the
    request's (layer, expert) pairs it summarises (top_k)."""

    top_k: Annotated[int, msgspec.Meta(ge=1, le=256)]
    candidates: list[AffinityCandidate]


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
    # The other choices of a fresh request with n > 1 (never on a moved one: each choice moves on its own).
    siblings: list[Sibling] = []
    cache_salt: CacheSalt = ""  # the prefix-cache salt: tenant and request (shared/prefix_hash.py request_salt)
    # decode-side reuse (docs/architecture.md): the decode worker whose cache holds most of the prompt, whose own
    # queue the decode job goes to (None: the shared decode queue); and whether the decode side may pull only
    # what its cache lacks (the gateway's decode_kv_reuse setting; carried on as DecodeJob.kv_reuse)
    decode_worker: str | None = None
    decode_kv_reuse: bool = True
    # decode routed by expert affinity (the gateway's expert_affinity_routing; None: off, or a KV holder was chosen):
    # the prefill worker hands the decode job to the candidate whose hot experts match the prompt's best
    decode_affinity: DecodeAffinity | None = None

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
    siblings: list[Sibling] = []  # the group's other unfinished choices, each with its first token
    # the attempt key the KV is held under when it is not this job's own (its group's first choice ended)
    kv_key: str | None = None
    # published before the first token existed (layer-streamed KV, docs/kv_transfer.md): output_token_ids stop
    # before it; the decode worker takes it from the pull's trailer (or samples it when it recomputes) and emits it
    kv_streamed: bool = False
    cache_salt: CacheSalt = ""  # as PrefillJob.cache_salt: a recompute or a cache lookup here uses the same
    # the gateway sent it here before any prefill (the local prefill path, services/gateway/prefill_path.py): the
    # decode worker computes the prompt in its own engine, samples the first token and decodes on; nothing to pull
    # (prefill_worker None, output_token_ids empty)
    prefill_here: bool = False
    # decode-side reuse (docs/architecture.md): this worker may take the prompt's first blocks from its own prefix
    # cache and pull only the rest (the gateway's decode_kv_reuse setting; off: the whole KV is pulled)
    kv_reuse: bool = True
    # the experts the prompt activated in its prefill (asked for by expert-affinity routing; None otherwise)
    hot_experts: HotExperts | None = None

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)


# A job kind: what a worker role takes (and what its ledger entries hold) is one of the two, fixed per role.
Job = TypeVar("Job", PrefillJob, DecodeJob)


# What a token event may carry (the gateway drops anything else as malformed): positions and attempts are never
# negative, and token ids fit the u32 every tokenizer uses (decoding a negative id fails in the detokenizer).
_Count = Annotated[int, msgspec.Meta(ge=0)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
_HttpStatus = Annotated[int, msgspec.Meta(ge=400, lt=600)]


class FinishReason(StrEnum):
    """Why a request ended, as its last event says: STOP / LENGTH end a FinishedEvent, ERROR / ABORT a FailedEvent.
    (The engine has its own enum; the wire's is this one, so the gateway never imports the engine.)"""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_NORMAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH)
_FAILURES = (FinishReason.ERROR, FinishReason.ABORT)


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprobs (shared/engine/logprobs.py says which distribution): the token's own, and the top
    alternatives, most likely first. Arrays on the wire: one per generated token."""

    logprob: float
    top_ids: list[_TokenId] = []
    top_logprobs: list[float] = []


# Token events: one struct per kind, a tagged union on the wire (`"kind": "taken"`, …; the union is TokenEvent,
# below). Each kind carries exactly its fields: a field of another kind, or no kind, makes an event malformed.
class _Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    request_id: str
    attempt: _Count  # bumped on every re-dispatch: events of an attempt older than the newest seen are stale


class TakenEvent(_Event, frozen=True, tag="taken"):
    """`worker_id` took the request's job: it holds the request from now on. `seq` is where its stage begins (the
    next position)."""

    seq: _Count
    worker_id: str


class QueuedEvent(_Event, frozen=True, tag="queued"):
    """No worker holds the request any more: it waits in a job queue for its next stage, from position `seq`.
    `routed_to`: the queue is that worker's own (a decode job routed for its cache): it holds the request now."""

    seq: _Count
    worker_id: str
    routed_to: str | None = None


class _Output(_Event, frozen=True):
    """Output tokens: `seq` is the output position of token_ids[0] (0 = the first generated token), whatever the
    attempt."""

    seq: _Count
    token_ids: list[_TokenId]
    worker_id: str = ""
    prompt_tokens: _Count = 0
    logprobs: list[Logprob] = []  # one per token_ids entry when the request asked (Sampling.logprobs)
    prompt_logprobs: list[Logprob] = []  # prompt positions 1.., on the first event of the worker that computed them
    cached_tokens: _Count = 0  # prompt tokens from the prefix cache, on the first event of the worker computing it

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError("an event carries one logprobs entry per token, or none")


class TokensEvent(_Output, frozen=True, tag="tokens"):
    """New tokens of a request that goes on."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.token_ids:
            raise ValueError("a tokens event carries at least one token")


class FinishedEvent(_Output, frozen=True, tag="finished", kw_only=True):
    """The request's last tokens (maybe none) and why it ended."""

    finish_reason: FinishReason  # stop | length

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finish_reason not in _NORMAL_ENDS:
            raise ValueError("a finished event ends with finish_reason stop or length (a failure is a failed event)")


class FailedEvent(_Event, frozen=True, tag="failed"):
    """The request ends without its answer, whatever position it reached."""

    error: str  # what went wrong
    status: _HttpStatus = 500  # the HTTP status it means (400 = the request itself was refused)
    worker_id: str = ""
    finish_reason: FinishReason = FinishReason.ERROR  # error | abort

    def __post_init__(self) -> None:
        if self.finish_reason not in _FAILURES:
            raise ValueError("a failed event ends with finish_reason error or abort")


# One event of a request, to the gateway that owns it. The gateway delivers positions in order, drops positions it
# already delivered (duplicates after a re-dispatch) and holds back early ones (two publishers: the prefill worker
# sends position 0, a decode worker the rest). Events also say who is responsible for the request's progress, so
# that the gateway can move it when that worker dies: every event of `worker_id` makes it the holder, until a
# QueuedEvent says the request waits in a job queue. Decode one with `decode_event`.
TokenEvent = TakenEvent | QueuedEvent | TokensEvent | FinishedEvent | FailedEvent


class Cancel(msgspec.Struct, frozen=True):
    request_id: str
    up_to_attempt: int | None = None  # drop attempts up to this one (the request moved on); None = all

    def covers(self, attempt: int) -> bool:
        return self.up_to_attempt is None or attempt <= self.up_to_attempt


# Token events travel on core NATS: one published while the bus was away (restarting, failing over) is lost. Every
# worker keeps what it sent (shared/worker/resend.py) and a gateway whose stream lacks positions asks for them again
# (services/gateway/resend_asks.py): docs/architecture.md, "Token events: resend".
RESEND_ITEMS_PER_MESSAGE = 1024  # the most requests one ResendRequest names: a longer list goes in several


class ResendItem(msgspec.Struct, frozen=True, array_like=True):
    """One request's events wanted again: those of `attempt` at output positions from `from_seq` on (the first the
    gateway has not delivered), and its end. Only the events of `attempt`: older attempts' are stale."""

    request_id: str
    attempt: _Count
    from_seq: _Count


class ResendRequest(msgspec.Struct, frozen=True):
    """A gateway's streams lack events: every worker that sent any of them sends them again, to the subject it first
    sent them to (the same token subject: the gateway's ordering drops what it already has)."""

    items: Annotated[list[ResendItem], msgspec.Meta(max_length=RESEND_ITEMS_PER_MESSAGE)]


class PathCalibration(msgspec.Struct, frozen=True):
    """A worker's live cost coefficients (shared/worker/calibration.py), in its heartbeat: what the gateway's choice
    between prefilling remotely (prefill worker + KV hand-off) and locally (on the decode worker) is computed from.
    Each coefficient is None until the worker has measured it (the gateway then uses its documented default)."""

    prefill_tokens_per_s: float | None = None  # steps that computed prompt tokens: the tokens' marginal rate
    prefill_step_ms: float | None = None  # ... and what such a step costs before its prompt tokens
    decode_step_ms: float | None = None  # a step that only decoded (its batch: the heartbeat's `running`)
    kv_transfer_ms_per_mb: float | None = None  # decode workers: KV pulls' marginal cost per MB (10^6 bytes)
    kv_pull_overhead_ms: float | None = None  # ... and a pull's fixed cost
    kv_bytes_per_token: int | None = None  # what a hand-off moves per prompt token (the engine's KV layout)


class Heartbeat(msgspec.Struct, frozen=True):
    worker_id: str
    role: Role
    model: str
    rpc_address: str | None  # prefill workers: where decode workers pull KV from
    running: int = 0
    waiting: int = 0
    # KV cache group 0's blocks (the full layers'; a one-group model's only group): what the gateway reads
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
    parallel: str = ""  # a worker group's layout ("tp=2 ep=1"); empty for a single-process worker
    rank_pids: tuple[int, ...] = ()  # a worker group's process ids, rank by rank (the leader's first)
    # every KV cache group's blocks, group 0 first (gpt-oss: the full layers, then the sliding window's); empty
    # from a worker that predates them
    kv_group_free_blocks: tuple[int, ...] = ()
    kv_group_total_blocks: tuple[int, ...] = ()
    # the prefill path's cost model (services/gateway/prefill_path.py): what this worker measured; None from a worker
    # that predates it
    path_calibration: PathCalibration | None = None
    waiting_tokens: int = 0  # prompt tokens queued in the engine, not computed yet (KV-aware routing's load)
    # the worker's prefix-cache block updates (KvBlockUpdate): the incarnation and the last sequence number sent,
    # so a gateway notices updates it lost at the end of a burst; "" = the worker announces no blocks
    kv_blocks_epoch: str = ""
    kv_blocks_seq: int = 0
    # an MoE decode (or mixed) worker's recent hot experts (shared/expert_affinity.py HotExpertsWindow), for the
    # gateway's expert-affinity routing; None: no routed experts, nothing routed yet, or a worker that predates it
    hot_experts: HotExperts | None = None
    # switching role (docs/architecture.md, "Role switching"): the role it becomes once what it holds is done; it
    # takes no new job meanwhile (`draining` is set too); None: not switching
    switching_to: Role | None = None
    # a data-parallel attention group (--dp-attention): per DP rank its running sequences and free KV blocks. A
    # request's KV goes whole into one rank's pool (the leader picks the least loaded), so what one request can
    # get is the freest rank's blocks (`fit_blocks`), not free_blocks; empty for any other worker
    dp_rank_running: tuple[int, ...] = ()
    dp_rank_free_blocks: tuple[int, ...] = ()

    @property
    def fit_blocks(self) -> int:
        """The most KV blocks one request can be given here."""
        return max(self.dp_rank_free_blocks) if self.dp_rank_free_blocks else self.free_blocks


# Prefix-cache block announcements (KV-aware routing): what a prefill (or mixed) worker holds, as block hashes
# (shared/prefix_hash.py). Every update of one worker incarnation (`epoch`) is numbered 1, 2, ... so a reader
# notices a gap; a snapshot says "after update `seq`, the worker holds exactly these" and may come in parts.
KV_HASHES_PER_MESSAGE = 4096  # the most hashes one message carries (~80 KB of JSON): longer lists are split
_BlockHash = Annotated[int, msgspec.Meta(ge=0)]  # 64-bit, unsigned (shared/prefix_hash.py)


class _KvBlockMessage(msgspec.Struct, frozen=True, tag_field="kind"):
    worker_id: str
    epoch: str  # one incarnation of the worker: a restart starts its numbering again
    seq: _Count
    block_size: Annotated[int, msgspec.Meta(ge=1)]  # tokens per hashed block


class KvBlockEvents(_KvBlockMessage, frozen=True, tag="events"):
    """Blocks removed, then blocks stored, since update seq - 1 (a hash is in one list at most)."""

    removed: list[_BlockHash] = []
    stored: list[_BlockHash] = []


class KvBlockSnapshot(_KvBlockMessage, frozen=True, tag="snapshot", kw_only=True):
    """Part `part` (0-based) of `parts` of every block the worker held after update `seq`. Published on the
    blocks subject (in the numbering: after its event log overflowed) or sent to one gateway that asked."""

    part: _Count = 0
    parts: Annotated[int, msgspec.Meta(ge=1)] = 1
    hashes: list[_BlockHash] = []


KvBlockUpdate = KvBlockEvents | KvBlockSnapshot


# Request statistics (pd.stats.requests.<model>): what the SLO planner (services/planner) forecasts load and lengths
# from. Fire and forget, as a metric: a lost one is a missing sample, never a lost request.
class _RequestStatBase(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True):
    gateway_id: str
    request_id: str
    prompt_tokens: _Count
    at: float  # time.time() when it happened, at the gateway


class RequestArrived(_RequestStatBase, frozen=True, tag="arrived"):
    """A valid request was dispatched: its prompt's length and the most it may generate (its output length is
    known only at its end)."""

    max_tokens: _Count


class RequestEnded(_RequestStatBase, frozen=True, tag="ended"):
    """A request's last token reached its client (or it failed): what it cost and how it was served. ttft_s and
    tpot_s are None when it had no first token (tpot_s also with a single token)."""

    output_tokens: _Count
    ttft_s: float | None = None
    tpot_s: float | None = None
    finish_reason: str = ""


RequestStat = RequestArrived | RequestEnded
_request_stat_decoder = msgspec.json.Decoder(RequestStat)


def decode_request_stat_or_drop(data: bytes, subject: str) -> RequestStat | None:
    return _or_drop(lambda: _guarded(lambda: _request_stat_decoder.decode(data)), "RequestStat", subject)


class KvSnapshotRequest(msgspec.Struct, frozen=True):
    """A gateway asks for snapshots (it started late, or lost updates): the workers named, every one if empty."""

    workers: list[str] = []

    def names(self, worker_id: str) -> bool:
        return not self.workers or worker_id in self.workers


# Role switching (docs/architecture.md, "Role switching"; shared/role_control/ signs, sends and checks these).
class RoleSwitchOrder(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Switch `worker_id` to `role`: the claims of a signed RoleControl (readable, unforgeable without the cluster
    secret). `nonce` makes each order single-use; `expires_ms` (wall clock, ms since the epoch) bounds its life."""

    worker_id: str
    role: Role
    expires_ms: int
    nonce: str
    # decode and mixed workers: how long the requests they decode may run on before they are handed on to the
    # prefill queue (their tokens so far kept); None: the worker's switch_finish_s
    finish_s: Annotated[float, msgspec.Meta(ge=0)] | None = None


class RoleControl(msgspec.Struct, frozen=True):
    """The request on `pd.control.<worker>`: an order (base64url JSON of a RoleSwitchOrder) and its HMAC-SHA256
    under the cluster secret (base64url)."""

    order: str
    mac: str


class SwitchOutcome(StrEnum):
    """How a role switch ended: the worker's answer, or the client's reason not to ask (shared/role_control/)."""

    SWITCHED = "switched"  # done: the worker serves its new role
    SAME_ROLE = "same_role"  # it has that role already
    BUSY = "busy"  # this worker is switching already
    LOCKED = "locked"  # another switch holds the deployment's lock (pd:admin:role-lock)
    UNSAFE = "unsafe"  # it is the last live worker of a role the deployment needs
    UNKNOWN_WORKER = "unknown_worker"  # no live worker of that id
    REFUSED = "refused"  # the order's signature, worker, expiry or nonce did not pass
    INVALID = "invalid"  # the worker cannot take that role (e.g. it has no cluster secret)
    TIMED_OUT = "timed_out"  # what it held did not settle in time: it serves its old role again
    STOPPING = "stopping"  # the worker is shutting down
    NO_REPLY = "no_reply"  # no answer in time (the switch may still complete: its heartbeat tells)


class RoleSwitchReply(msgspec.Struct, frozen=True):
    """A worker's answer to a RoleControl, sent once the switch is done (or refused, or given up)."""

    worker_id: str
    outcome: SwitchOutcome
    role: Role  # the worker's role now
    previous_role: Role | None = None
    detail: str = ""  # why, for every outcome but switched
    took_s: float = 0.0  # order received → the new role serving (or the refusal)
    finished: int = 0  # requests in hand that finished (or were handed on to decode as usual) in the old role
    handed_on: int = 0  # decode / mixed: requests moved to the prefill queue with their tokens so far


_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


_S = TypeVar("_S", bound=msgspec.Struct)
_T = TypeVar("_T")


def decode(data: bytes, kind: type[_S]) -> _S:
    """Raises msgspec.ValidationError / DecodeError on malformed input."""
    return _guarded(lambda: msgspec.json.decode(data, type=kind))


_event_decoder: msgspec.json.Decoder[TokenEvent] = msgspec.json.Decoder(TokenEvent)
_kv_block_decoder: msgspec.json.Decoder[KvBlockUpdate] = msgspec.json.Decoder(KvBlockUpdate)


def decode_event(data: bytes) -> TokenEvent:
    """A token event of whichever kind its tag says. Raises msgspec.ValidationError / DecodeError on malformed input
    (no kind, an unknown one, or a field the kind does not carry)."""
    return _guarded(lambda: _event_decoder.decode(data))


def _guarded(decoding: Callable[[], _T]) -> _T:
    try:
        return decoding()
    except RecursionError as exc:  # msgspec's guard against arrays / objects nested thousands deep
        raise msgspec.DecodeError("JSON is nested too deeply") from exc


def decode_kv_blocks_or_drop(data: bytes, subject: str) -> KvBlockUpdate | None:
    """A block update of whichever kind its tag says, or None after logging why (as decode_or_drop)."""
    return _or_drop(lambda: _guarded(lambda: _kv_block_decoder.decode(data)), "KvBlockUpdate", subject)


def decode_or_drop(data: bytes, kind: type[_S], subject: str) -> _S | None:
    """`decode`, or None after logging why: a malformed message is dropped, never fatal to its reader."""
    return _or_drop(lambda: decode(data, kind), kind.__name__, subject)


def decode_event_or_drop(data: bytes, subject: str) -> TokenEvent | None:
    """`decode_event`, or None after logging why (as decode_or_drop)."""
    return _or_drop(lambda: decode_event(data), "TokenEvent", subject)


def _or_drop(decoding: Callable[[], _T], name: str, subject: str) -> _T | None:
    try:
        return decoding()
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _log.warning("dropping malformed %s on %s: %s", name, subject, exc)
        return None
