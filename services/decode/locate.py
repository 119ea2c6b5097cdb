"""Admission stage 1, locate: where a decode job's KV is held (its Redis record), or why it cannot be had.

The record is written by the prefill worker's hold (shared/kv/held.py) and read here only; a miss is never
waited on: the request is recomputed (or failed, kv_fallback `fail`) by the pipeline (worker.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from shared.kv.registry import KvLocation
from shared.messages import DecodeJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Missing:
    """The request's KV cannot be imported here, and why. `may_fail`: a lost KV (kv_fallback `fail` answers the
    request with an error); False where no KV was promised or it merely does not fit (a request moved here with
    nothing to pull, an import with no room): always recomputed."""

    reason: str
    may_fail: bool = True


class LocationReader(Protocol):
    async def get(self, request_id: str, /) -> KvLocation | None: ...


def kv_key(job: DecodeJob) -> str:
    """The attempt key the job's KV is held under (a group's KV under its first choice's key)."""
    return job.kv_key or job.key


async def locate(registry: LocationReader, job: DecodeJob) -> KvLocation | Missing:
    """The job's KV location from Redis, or Missing: nothing to pull (a moved request), Redis unreachable, or
    no record (the prefill worker freed it or its lease expired)."""
    if job.prefill_worker is None:
        return Missing("nothing to pull", may_fail=False)
    key = kv_key(job)
    try:
        loc = await registry.get(key)
    except Exception as exc:  # Redis unreachable: the KV cannot be found
        log.warning("reading the KV location of %s failed (%s)", key, exc)
        return Missing(f"reading its location failed: {exc}")
    if loc is None:
        log.warning("no KV location for %s (lease expired?)", key)
        return Missing(f"no KV location (prefill worker {job.prefill_worker} freed it, or its lease expired)")
    return loc
