"""Per-service settings: frozen, validated, and parsed from the environment here and nowhere else.

Every setting is one field with its docstring (shared/config_fields.py derives the rest): it can be set as
PDSERVE_<NAME> (upper case), or read from a file named by PDSERVE_<NAME>_FILE (Docker secrets: passwords and
keys never need to sit in the environment); its command-line flag `--<name>` overrides both. Workers nest the
engine's own config (shared/engine: EngineConfig, its SchedulerConfig) and the KV transfer's section.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from enum import StrEnum

from shared.config_fields import flat, from_args, from_env, section
from shared.engine.config import EngineConfig

__all__ = [
    "CommonSettings",
    "GatewaySettings",
    "KvBackend",
    "KvFallback",
    "KvTransferSettings",
    "PrefillPath",
    "PrefillPathSettings",
    "PlannerSettings",
    "WorkerRole",
    "WorkerSettings",
    "from_args",
    "from_env",
]

DEFAULT_MODEL = "models/demo-tiny-qwen3_moe"


def _default_id(prefix: str) -> str:
    return f"{prefix}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class CommonSettings:
    model_name: str | None = None
    """Name clients use in the `model` field; defaults to the checkpoint directory's name."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server (JetStream enabled); tls:// turns TLS on."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server; rediss:// turns TLS on."""
    redis_sentinels: tuple[str, ...] = ()
    """Redis Sentinels (host:port, comma-separated): when set, the services ask them for the primary named
    redis_sentinel_master and follow its failovers; redis_url then gives only the scheme, database and credentials."""
    redis_sentinel_master: str = "pdserve"
    """The name the Sentinels monitor the Redis primary under."""
    jetstream_replicas: int = 1
    """Replicas of the JetStream streams and their consumers (1-5; 3 on a 3-node nats-server cluster). Every service
    creates or updates the streams at start with this; one that says fewer than a stream has never scales it down."""
    trace_file: str | None = None
    """Also append this service's spans to this JSON-lines file (`pdserve trace` reads it). OTLP export is
    configured by the standard OTEL_* variables."""
    # NATS and Redis credentials and TLS (the URLs may carry credentials too; these win).
    nats_user: str | None = None
    """NATS user name."""
    nats_password: str | None = field(default=None, repr=False)
    """NATS password (or token, without a user)."""
    nats_tls_ca: str | None = None
    """CA bundle that verifies the NATS server's certificate; setting it (or a tls:// URL) turns TLS on."""
    nats_tls_cert: str | None = None
    """Client certificate and key, for servers that verify clients (mutual TLS)."""
    nats_tls_key: str | None = None
    """Key of nats_tls_cert."""
    redis_username: str | None = None
    """Redis ACL user name."""
    redis_password: str | None = field(default=None, repr=False)
    """Redis password."""
    redis_tls_ca: str | None = None
    """CA bundle that verifies the Redis server's certificate; setting it (or a rediss:// URL) turns TLS on."""
    redis_tls_cert: str | None = None
    """Client certificate, for Redis servers that verify clients (mutual TLS)."""
    redis_tls_key: str | None = None
    """Key of redis_tls_cert."""
    log_prompts: bool = False
    """Write prompt and completion text to the logs (debugging only: prompts are user data)."""
    drain_timeout_s: float = 60.0
    """On SIGTERM: stop taking new work, finish what is in flight for at most this long, then exit."""

    def _served_name(self, checkpoint: str) -> str:
        return self.model_name or os.path.basename(os.path.normpath(checkpoint))

    def __post_init__(self) -> None:
        if not 1 <= self.jetstream_replicas <= 5:
            raise ValueError(f"jetstream_replicas must be 1-5 (JetStream's limit), got {self.jetstream_replicas}")
        for address in self.redis_sentinels:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"redis_sentinels: {address!r} is not host:port")


class ToolCallParser(StrEnum):
    """How the gateway reads tool calls out of model output (services/gateway/tools/)."""

    AUTO = "auto"  # from the chat template
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class PrefillPath(StrEnum):
    """Where a request's prompt is computed (services/gateway/prefill_path.py, docs/architecture.md)."""

    AUTO = "auto"  # per request, by the cost model
    REMOTE = "remote"  # on a prefill worker, its KV handed off to a decode worker (every request, as before it)
    LOCAL = "local"  # on the decode worker that decodes it (no hand-off), whenever a decode worker is live


@dataclass(frozen=True)
class PrefillPathSettings:
    """The gateway's choice of prefill path per request (services/gateway/prefill_path.py)."""

    prefill_path: PrefillPath = PrefillPath.AUTO
    """auto: per request, the path the cost model predicts to start decoding sooner within the SLOs; remote: every
    prompt on a prefill worker, its KV handed off (disaggregated throughout); local: every prompt on the decode
    worker that decodes it, when a decode worker is live."""
    ttft_slo_ms: float = 2500.0
    """Target time to first token: the local path is taken only where it meets it (or beats the remote path's)."""
    tpot_slo_ms: float = 100.0
    """Target time per output token: the local path is taken only where the decode worker's mean TPOT, with the
    share of its time its local prompts take, stays within it (the decode batch's protection)."""
    local_prefill_max_stall_ms: float = 250.0
    """The longest pause one local prompt may put in the token streams decoding beside it (an inter-token latency
    bound): the decode step plus the prompt's compute. Longer prompts go remote (disaggregation's reason)."""
    prefill_path_live_calibration: bool = True
    """Predict from the coefficients the workers measure and report in their heartbeats; false: from the documented
    defaults only (reproducible choices, e.g. for tests and benchmarks)."""

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0 or self.local_prefill_max_stall_ms <= 0:
            raise ValueError("ttft_slo_ms, tpot_slo_ms and local_prefill_max_stall_ms must be positive")


@dataclass(frozen=True)
class GatewaySettings(CommonSettings):
    model: str = DEFAULT_MODEL
    """Checkpoint directory (Hugging Face layout): the gateway reads its tokenizer and chat template."""
    host: str = "0.0.0.0"
    """Address the HTTP server binds to."""
    port: int = 8000
    """HTTP port."""
    gateway_id: str = field(default_factory=lambda: _default_id("gw"))
    """This gateway's name on the bus (its token subjects); default: host name + a random suffix."""
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"flag": True})
    """Accepted `Authorization: Bearer` keys, comma-separated; empty = no authentication."""
    admin_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"flag": True})
    """Keys of the admin API (/admin: list the workers, switch a worker's role), `Authorization: Bearer`,
    comma-separated; empty = the admin API is off (403). Apart from api_keys: an API key is not an admin key."""
    cluster_secret: str | None = field(default=None, repr=False)
    """The workers' cluster secret (PDSERVE_CLUSTER_SECRET): the admin API signs role-switch orders with it; without
    it the admin API can list workers but not switch them."""
    max_body_bytes: int = 4 << 20
    """Largest request body accepted (413 past it)."""
    request_timeout_s: float = 600.0
    """A request with no progress for this long fails with a clear error."""
    first_token_timeout_s: float = 300.0
    """A request with no first token for this long fails with a clear error."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, in tokens; None = the model's context length."""
    worker_ttl_s: float = 5.0
    """A worker whose heartbeat is older than this is dead: its requests move to another worker."""
    stall_timeout_s: float = 30.0
    """A request whose worker is alive but produced nothing for this long moves to another worker."""
    max_migrations: int = 3
    """Times one request may move to another worker before it fails."""
    max_pending_requests: int = 256
    """Admission: requests dispatched and still waiting for their first token; past it, 429."""
    kv_overcommit: float = 1.0
    """Admission: in-flight tokens may reach this multiple of the live workers' KV capacity; past it, 429."""
    admission_ttft_refuse: bool = False
    """Admission: refuse (429) a request whose predicted time to first token, on the prefill path chosen for it,
    exceeds admission_ttft_factor × ttft_slo_ms because of the backlog ahead of it (behind no queue it would meet
    that), with Retry-After the predicted time until the backlog has drained that far. Off: such a request is
    accepted and waits (services/gateway/admission.py)."""
    admission_ttft_factor: float = 1.0
    """Admission with admission_ttft_refuse: the multiple of ttft_slo_ms past which a predicted TTFT is refused
    (above 1 refuses only clear misses; the predictions run under measured TTFTs: docs/benchmarks.md)."""
    tool_call_parser: ToolCallParser = ToolCallParser.AUTO
    """How model output is read back into tool_calls: hermes (Qwen), llama3_json, or auto (from the chat template)."""
    max_n: int = 16
    """The most choices (`n`) one request may ask for; more is a 400. Each choice is a sequence of its own in the
    workers' engines (its prompt KV shared) and counts as one request for admission."""
    path: PrefillPathSettings = section(PrefillPathSettings)
    kv_aware_routing: bool = True
    """Send a prompt to the prefill (or mixed) worker whose prefix cache holds most of it, from the blocks the
    workers announce (docs/architecture.md); false: every prompt goes to the shared queue."""
    kv_routing_max_queued_tokens: int = 8192
    """KV-aware routing: a worker with this many prompt tokens queued (its heartbeat's, plus those this gateway
    routed to it and it has not taken yet) is overloaded: prompts go elsewhere, whatever it holds."""
    decode_kv_reuse: bool = True
    """Decode-side reuse (docs/architecture.md): a prefilled request goes to the decode worker whose prefix cache
    holds most of its prompt (with kv_aware_routing: from the blocks decode workers announce), and a decode
    worker pulls only the KV blocks its cache lacks; false: the shared decode queue and whole pulls."""
    expert_affinity_routing: bool = False
    """Decode routed by expert affinity (MoE models; docs/architecture.md): when no decode worker's cache holds
    any of the prompt, the prefill worker hands the decode job to the decode worker whose recent hot experts (its
    heartbeat's) overlap most with the experts the prompt activated; no overlap: the shared decode queue. Off by
    default: whether it pays depends on the deployment (benchmarks/affinity_bench.py). Never changes tokens."""
    expert_affinity_top_k: int = 8
    """Expert-affinity routing: how many of a request's (layer, expert) pairs, heaviest first, its prefill
    summarises for the match (1-256)."""

    @property
    def served_model_name(self) -> str:
        return self._served_name(self.model)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be positive")
        for name in ("worker_ttl_s", "stall_timeout_s", "kv_overcommit", "admission_ttft_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.kv_routing_max_queued_tokens < 1:
            raise ValueError("kv_routing_max_queued_tokens must be >= 1")
        if self.max_migrations < 0 or self.max_pending_requests < 1:
            raise ValueError("max_migrations must be >= 0 and max_pending_requests >= 1")
        if not 1 <= self.expert_affinity_top_k <= 256:
            raise ValueError(f"expert_affinity_top_k must be in 1-256, got {self.expert_affinity_top_k}")
        if self.cluster_secret is not None and len(self.cluster_secret.encode()) < 16:
            raise ValueError("cluster_secret must be at least 16 bytes (the workers' own)")


@dataclass(frozen=True)
class PlannerSettings(CommonSettings):
    """The SLO planner (`pdserve planner`, services/planner; docs/planning.md)."""

    model: str = DEFAULT_MODEL
    """Checkpoint (or its served name's directory) whose workers it plans: the served model name is taken from it,
    as the gateway's is."""
    host: str = "127.0.0.1"
    """Where its JSON (/plan) and Prometheus (/metrics) endpoint listens."""
    port: int = 8090
    """... and its port (0: any free port)."""
    ttft_slo_ms: float = 2500.0
    """The TTFT SLO it keeps the p90 under (the gateway's prefill path uses the same default)."""
    tpot_slo_ms: float = 100.0
    """The TPOT SLO it keeps the requests' TPOT under."""
    interval_s: float = 5.0
    """How often it decides."""
    confirm_intervals: int = 2
    """Intervals in a row the same better split must be seen before a worker is switched (hysteresis)."""
    cooldown_s: float = 30.0
    """The least time between two switches."""
    margin: float = 0.2
    """A better split must score this share below the current one (or rescue a missed SLO) to be acted on."""
    switch_roles: bool = True
    """Switch workers' roles; off: only forecast and publish the wanted counts (an autoscaler acts on them)."""
    worker_ttl_s: float = 5.0
    """A worker not heard from for this long is gone."""
    cluster_secret: str | None = field(default=None, repr=False)
    """The secret the cluster's control calls are signed with (role switches); required to switch roles."""

    @property
    def served_model_name(self) -> str:
        return self._served_name(self.model)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "interval_s", "worker_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.confirm_intervals < 1:
            raise ValueError("confirm_intervals must be >= 1")
        if self.cooldown_s < 0:
            raise ValueError("cooldown_s must not be negative")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.switch_roles and self.cluster_secret is None:
            raise ValueError(
                "the planner switches roles with the cluster's control calls: set cluster_secret "
                "(PDSERVE_CLUSTER_SECRET or PDSERVE_CLUSTER_SECRET_FILE), or --no-switch-roles to only publish counts"
            )


class WorkerRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prefill and decode in one engine, no transfer


class KvBackend(StrEnum):
    """The transfer plane's TransferBackend by value, named here without importing torch."""

    GLOO = "gloo"  # CPU tensors over TCP
    NCCL = "nccl"  # both sides on CUDA


class KvFallback(StrEnum):
    """What a decode worker does when a request's KV cannot be pulled."""

    RECOMPUTE = "recompute"  # prefill the prompt again, locally
    FAIL = "fail"  # a clear error


@dataclass(frozen=True)
class KvTransferSettings:
    """The KV hand-off between prefill and decode workers (shared/kv/transfer). Names keep the kv_ prefix
    of the section, or their own flat names from before the section existed."""

    rpc_host: str = flat("rpc_host", "127.0.0.1")
    """Address the KV transfer server binds to and advertises (prefill workers)."""
    rpc_port: int = flat("rpc_port", 0)
    """Port of the KV transfer server; 0 = any free port."""
    advertise_host: str | None = flat("advertise_host", None)
    """Host decode workers dial for KV pulls; None = rpc_host, or this machine's name when rpc_host is a
    wildcard such as 0.0.0.0 (containers: the service's DNS name)."""
    lease_s: float = 30.0
    """Prefill workers free a request's KV if no decode worker pulled it within this time."""
    backend: KvBackend = flat("transfer_backend", KvBackend.GLOO)
    """gloo (CPU) | nccl (both sides on CUDA)."""
    timeout_s: float = flat("kv_transfer_timeout_s", 30.0)
    """Bounds forming a transfer pair and each KV send / receive."""
    chunk_bytes: int = 64 << 20
    """KV moves in pieces of at most this many bytes (0 = one piece)."""
    shm_bytes: int = 256 << 20
    """Same-host pairs (prefill and decode report one host identity): the shared-memory segment each pair
    gets, and the largest KV it carries (bigger KV goes over the socket); 0 = never shared memory."""
    share_pool: bool = True
    """Prefill workers on CPU: keep the KV pool in a memfd that same-host decode workers map read-only and copy a
    request's blocks from straight into their own pool (one copy per hand-off; shared/kv/transfer/borrow.py). Needs
    shm_bytes > 0 (the same-host path). False: same-host hand-offs go through the pair's segment (two copies)."""
    fallback: KvFallback = KvFallback.RECOMPUTE
    """Decode workers, when the KV cannot be pulled: recompute (the prompt again) | fail (a clear error)."""
    stream_layers: bool = False
    """Prefill workers: send a request's KV layer by layer while its last prefill chunk runs, and publish the
    decode job before the first token exists (the decode worker then emits it). Only single-choice jobs on a
    CPU, single-process engine without sliding windows, max_tokens > 1, no logprobs; others hand off as usual."""
    fault_send_midway: bool = flat("fault_kv_send_midway", False)
    """Testing only: every KV send stops after its first piece and drops the pair (an injected failure)."""
    fault_send_stall_s: float = flat("fault_kv_send_stall_s", 0.0)
    """Testing only: every KV send over a pair sleeps this long after its first piece (a window in which to
    kill the prefill worker mid-transfer, mid-stream for a layer-streamed send); 0 = off."""
    # Mutual TLS on the transfer gRPC (shared/kv/transfer/channel_tls.py): all three files, or none.
    tls_ca: str | None = None
    """CA bundle that signs every prefill and decode worker's KV transfer certificate; with kv_tls_cert and
    kv_tls_key it turns TLS with client certificates on for KV transfer gRPC."""
    tls_cert: str | None = None
    """This worker's certificate for KV transfer gRPC (prefill: must name the advertised transfer host)."""
    tls_key: str | None = None
    """Key of kv_tls_cert."""
    tls_server_name: str | None = None
    """Decode workers: the name expected in prefill workers' certificates instead of the host dialled."""
    replay_cache_entries: int = 1 << 18
    """Prefill workers: the most unexpired tickets remembered to refuse their reuse; when full, calls are
    refused until some expire (about 4000 calls/s at the default 65 s ticket window)."""

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError("kv_lease_s must be positive")
        if self.fault_send_stall_s < 0:
            raise ValueError("fault_kv_send_stall_s must be >= 0")
        if self.timeout_s <= 0 or self.chunk_bytes < 0 or self.shm_bytes < 0:
            raise ValueError("kv_transfer_timeout_s must be positive, kv_chunk_bytes and kv_shm_bytes >= 0")
        if self.replay_cache_entries < 1:
            raise ValueError("kv_replay_cache_entries must be at least 1")
        tls = {"CA": self.tls_ca, "CERT": self.tls_cert, "KEY": self.tls_key}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(f"PDSERVE_KV_TLS_{name}" for name, value in tls.items() if not value)
            raise ValueError(f"KV transfer TLS needs PDSERVE_KV_TLS_CA, _CERT and _KEY together; missing: {missing}")

    @property
    def tls_files(self) -> tuple[str | None, str | None, str | None, str | None]:
        """(ca, cert, key, server name), as KvTls.load takes them."""
        return self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name


@dataclass(frozen=True)
class WorkerSettings(CommonSettings):
    role: WorkerRole = WorkerRole.MIXED
    """prefill | decode | mixed (the subcommand sets it)."""
    worker_id: str = field(default_factory=lambda: _default_id("worker"))
    """This worker's name on the bus, in heartbeats and metrics; default: host name + a random suffix."""
    engine: EngineConfig = section(lambda: EngineConfig(model=DEFAULT_MODEL))
    kv: KvTransferSettings = section(KvTransferSettings, prefix="kv_")
    cluster_secret: str | None = field(default=None, repr=False)
    """Shared by every prefill and decode worker of a deployment: KV pull tickets are signed with it.
    Required for the prefill and decode roles (`pdserve up` generates one)."""
    job_ack_wait_s: float = 30.0
    """A job fetched by a worker that neither acks it nor reports progress for this long is redelivered."""
    metrics_host: str = "127.0.0.1"
    """Where the worker serves Prometheus /metrics (containers: 0.0.0.0)."""
    metrics_port: int | None = 0
    """Port of /metrics; 0 = any free port (logged); empty = no metrics server."""
    record_expert_trace: str | None = None
    """Append every step's tokens per expert, per sparse layer, to this expert routing trace (JSON lines, with
    the role; shared/sharding/expert_trace.py) for benchmarks/eplb_sim.py and `pdserve experts show`. MoE only."""
    switch_finish_s: float = 10.0
    """Switching role (docs/architecture.md, "Role switching"): how long a decode or mixed worker lets the requests
    it decodes run on before it hands the rest to the prefill queue with their tokens so far (an order may say
    otherwise). 0: hand them on at once."""

    @property
    def served_model_name(self) -> str:
        return self._served_name(self.engine.model)

    @property
    def ticket_secret(self) -> str:
        """cluster_secret, for the roles that sign and check KV pull tickets (prefill and decode: __post_init__
        requires one of them); a ValueError for a worker without one."""
        if not self.cluster_secret:
            raise ValueError(f"a {self.role} worker has no cluster_secret to sign KV pull tickets with")
        return self.cluster_secret

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be 0-65535, got {self.metrics_port}")
        if self.role not in tuple(WorkerRole):
            raise ValueError(f"role must be prefill, decode or mixed, got {self.role!r}")
        if self.job_ack_wait_s <= 0:
            raise ValueError("job_ack_wait_s must be positive")
        if self.switch_finish_s < 0:
            raise ValueError("switch_finish_s must be >= 0")
        if self.role in (WorkerRole.PREFILL, WorkerRole.DECODE) and not self.cluster_secret:
            raise ValueError(
                f"a {self.role} worker needs cluster_secret (PDSERVE_CLUSTER_SECRET or PDSERVE_CLUSTER_SECRET_FILE): "
                "every prefill and decode worker shares it to sign and check KV pull tickets"
            )
        if self.cluster_secret is not None and len(self.cluster_secret.encode()) < 16:
            raise ValueError("cluster_secret must be at least 16 bytes (e.g. `openssl rand -base64 32`)")
