"""Helpers for end-to-end tests against a running stack (real processes)."""

from __future__ import annotations

from services.launcher import Stack, StackSpec
from shared.cluster_state import heartbeats, kv_keys

__all__ = ["heartbeats", "kv_keys", "start_stack"]


def start_stack(spec: StackSpec, log_dir: str | None = None, ready_timeout_s: float = 180) -> Stack:
    """A started stack; if it does not come up, its services' logs are printed before the error propagates."""
    stack = Stack(spec, log_dir=log_dir)
    try:
        return stack.start(ready_timeout_s=ready_timeout_s)
    except Exception:
        print(stack.logs())
        raise
