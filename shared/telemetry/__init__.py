"""Observability, kept thin: `tracing` (OpenTelemetry spans at phase boundaries, carried across NATS and
gRPC), `metrics` (Prometheus, vLLM-style names), `spanfile` (spans as JSON lines) and `timeline` (one
request's spans as a readable timeline)."""
