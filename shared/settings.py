"""Per-service settings: frozen, validated, and parsed from the environment here and nowhere else.

Every field can be set as PDSERVE_<FIELD> (upper case), or read from a file named by PDSERVE_<FIELD>_FILE
(Docker secrets: passwords and keys never need to sit in the environment); command-line flags override both.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any


def _default_id(prefix: str) -> str:
    return f"{prefix}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class CommonSettings:
    model: str = "models/demo-tiny-qwen3_moe"
    """Checkpoint directory (Hugging Face layout)."""
    model_name: str | None = None
    """Name clients use in the `model` field; defaults to the directory's name."""
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    trace_file: str | None = None
    """Also append this service's spans to this JSON-lines file (`pdserve trace` reads it). OTLP export is
    configured by the standard OTEL_* variables."""
    # NATS and Redis credentials and TLS (the URLs may carry credentials too; these win).
    nats_user: str | None = None
    nats_password: str | None = field(default=None, repr=False)
    nats_tls_ca: str | None = None
    """CA bundle that verifies the NATS server's certificate; setting it (or a tls:// URL) turns TLS on."""
    nats_tls_cert: str | None = None
    """Client certificate and key, for servers that verify clients (mutual TLS)."""
    nats_tls_key: str | None = None
    redis_username: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    redis_tls_ca: str | None = None
    """CA bundle that verifies the Redis server's certificate; setting it (or a rediss:// URL) turns TLS on."""
    redis_tls_cert: str | None = None
    redis_tls_key: str | None = None
    log_prompts: bool = False
    """Write prompt and completion text to the logs (debugging only: prompts are user data)."""
    drain_timeout_s: float = 60.0
    """On SIGTERM: stop taking new work, finish what is in flight for at most this long, then exit."""

    @property
    def served_model_name(self) -> str:
        return self.model_name or os.path.basename(os.path.normpath(self.model))


@dataclass(frozen=True)
class GatewaySettings(CommonSettings):
    host: str = "0.0.0.0"
    port: int = 8000
    gateway_id: str = field(default_factory=lambda: _default_id("gw"))
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted `Authorization: Bearer` keys; empty = no authentication."""
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0
    """A request with no progress for this long fails with a clear error."""
    first_token_timeout_s: float = 300.0
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

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be positive")
        for name in ("worker_ttl_s", "stall_timeout_s", "kv_overcommit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_migrations < 0 or self.max_pending_requests < 1:
            raise ValueError("max_migrations must be >= 0 and max_pending_requests >= 1")


@dataclass(frozen=True)
class WorkerSettings(CommonSettings):
    role: str = "mixed"
    """prefill | decode | mixed"""
    worker_id: str = field(default_factory=lambda: _default_id("worker"))
    rpc_host: str = "127.0.0.1"
    """Address the KV transfer server binds to and advertises (prefill workers)."""
    rpc_port: int = 0
    """0 = any free port."""
    advertise_host: str | None = None
    """Host decode workers dial for KV pulls; None = rpc_host, or this machine's name when rpc_host is a
    wildcard such as 0.0.0.0 (containers: the service's DNS name)."""
    threads: int | None = None
    """torch intra-op threads for this worker; None = torch's default."""
    dtype: str | None = None
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    kv_lease_s: float = 30.0
    """Prefill workers free a request's KV if no decode worker pulled it within this time."""
    transfer_backend: str = "gloo"
    """gloo (CPU) | nccl (both sides on CUDA)"""
    cluster_secret: str | None = field(default=None, repr=False)
    """Shared by every prefill and decode worker of a deployment: KV pull tickets are signed with it.
    Required for the prefill and decode roles (`pdserve up` generates one)."""
    kv_transfer_timeout_s: float = 30.0
    """Bounds forming a transfer pair and each KV send / receive."""
    kv_chunk_bytes: int = 64 << 20
    """KV moves in pieces of at most this many bytes (0 = one piece)."""
    kv_fallback: str = "recompute"
    """Decode workers, when the KV cannot be pulled: recompute (the prompt again) | fail (a clear error)."""
    fault_kv_send_midway: bool = False
    """Testing only: every KV send stops after its first piece and drops the pair (an injected failure)."""
    job_ack_wait_s: float = 30.0
    """A job fetched by a worker that neither acks it nor reports progress for this long is redelivered."""
    device: str = "cpu"
    metrics_host: str = "127.0.0.1"
    """Where the worker serves Prometheus /metrics (containers: 0.0.0.0)."""
    metrics_port: int | None = 0
    """0 = any free port (logged); None = no metrics server."""

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be 0-65535, got {self.metrics_port}")
        if self.role not in ("prefill", "decode", "mixed"):
            raise ValueError(f"role must be prefill, decode or mixed, got {self.role!r}")
        if self.transfer_backend not in ("gloo", "nccl"):
            raise ValueError(f"transfer_backend must be gloo or nccl, got {self.transfer_backend!r}")
        if self.kv_lease_s <= 0:
            raise ValueError("kv_lease_s must be positive")
        if self.kv_fallback not in ("recompute", "fail"):
            raise ValueError(f"kv_fallback must be recompute or fail, got {self.kv_fallback!r}")
        if self.kv_transfer_timeout_s <= 0 or self.job_ack_wait_s <= 0 or self.kv_chunk_bytes < 0:
            raise ValueError("kv_transfer_timeout_s and job_ack_wait_s must be positive, kv_chunk_bytes >= 0")
        if self.role in ("prefill", "decode") and not self.cluster_secret:
            raise ValueError(
                f"a {self.role} worker needs cluster_secret (PDSERVE_CLUSTER_SECRET or PDSERVE_CLUSTER_SECRET_FILE): "
                "every prefill and decode worker shares it to sign and check KV pull tickets"
            )
        if self.cluster_secret is not None and len(self.cluster_secret.encode()) < 16:
            raise ValueError("cluster_secret must be at least 16 bytes (e.g. `openssl rand -base64 32`)")


def from_env(cls: type, environ: dict[str, str] | None = None, **overrides: Any):
    """Build `cls` from PDSERVE_* variables, then `overrides` (None values are ignored)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(f"PDSERVE_{f.name.upper()}")
        path = environ.get(f"PDSERVE_{f.name.upper()}_FILE")
        if raw is None and path:
            raw = _read_secret_file(f"PDSERVE_{f.name.upper()}_FILE", path)
        if raw is not None:
            values[f.name] = _parse(f.name, raw, f.type)
    values |= {k: v for k, v in overrides.items() if v is not None}
    return cls(**values)


def _read_secret_file(variable: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise ValueError(f"{variable}={path!r} cannot be read: {exc.strerror}") from exc


def _parse(name: str, raw: str, annotation: Any) -> Any:
    kind = str(annotation)
    try:
        if "tuple" in kind:
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if kind.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"PDSERVE_{name.upper()}={raw!r} is not a valid {kind}") from exc
    return raw or None if "None" in kind else raw
