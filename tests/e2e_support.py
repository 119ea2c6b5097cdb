"""Helpers for end-to-end tests against a running stack (real processes)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.local.cluster_state import heartbeats, kv_keys
from services.local.stack import Stack, StackSpec

__all__ = ["heartbeats", "kv_connect_status", "kv_keys", "scraped_total", "start_stack"]


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


def kv_connect_status(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The status of a KV transfer Connect with an empty body at `address`: INVALID_ARGUMENT from the server's
    own checks when the channel got through (with TLS: the handshake passed, the server's certificate names the
    address dialled), UNAVAILABLE when the handshake did not. credentials None: plaintext."""

    async def call() -> str:
        channel = (
            grpc.aio.insecure_channel(address) if credentials is None else grpc.aio.secure_channel(address, credentials)
        )
        async with channel:
            try:
                await channel.unary_unary("/pdserve.kv.v1.KvTransfer/Connect")(b"", timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return "OK"

    return asyncio.run(call())
