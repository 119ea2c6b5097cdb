"""Per-service settings: frozen, validated, and parsed from the environment here and nowhere else.

Every field can be set as PDSERVE_<FIELD> (upper case); command-line flags override the environment.
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

    @property
    def served_model_name(self) -> str:
        return self.model_name or os.path.basename(os.path.normpath(self.model))


@dataclass(frozen=True)
class GatewaySettings(CommonSettings):
    host: str = "0.0.0.0"
    port: int = 8000
    gateway_id: str = field(default_factory=lambda: _default_id("gw"))
    api_keys: tuple[str, ...] = ()
    """Accepted `Authorization: Bearer` keys; empty = no authentication."""
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0
    """A request with no progress for this long fails with a clear error."""
    first_token_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")


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


def from_env(cls: type, environ: dict[str, str] | None = None, **overrides: Any):
    """Build `cls` from PDSERVE_* variables, then `overrides` (None values are ignored)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(f"PDSERVE_{f.name.upper()}")
        if raw is not None:
            values[f.name] = _parse(f.name, raw, f.type)
    values |= {k: v for k, v in overrides.items() if v is not None}
    return cls(**values)


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
