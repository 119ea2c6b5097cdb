"""Helpers for end-to-end tests against a running stack (real processes)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.local.cluster_state import heartbeats, kv_keys
from services.local.stack import Stack, StackSpec

__all__ = ["heartbeats", "kv_keys", "scraped_total", "start_stack"]


def start_stack(spec: StackSpec, log_dir: str | None = None, ready_timeout_s: float = 180) -> Stack:
    """A started stack; if it does not come up, its services' logs are printed before the error propagates."""
    stack = Stack(spec, log_dir=log_dir)
    try:
        return stack.start(ready_timeout_s=ready_timeout_s)
    except Exception:
        print(stack.logs())
        raise


def scraped_total(url: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples whose labels include `labels`, scraped from a /metrics URL (parsed by
    prometheus_client)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
