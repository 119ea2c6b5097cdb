"""The OpenAI-compatible REST gateway: validates, tokenizes, dispatches to prefill/decode over NATS,
and streams the answer back (SSE). See docs/api.md."""

from services.gateway.app import create_app

__all__ = ["create_app"]
