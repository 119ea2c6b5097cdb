"""Where each request's KV blocks live, in Redis, under a lease.

Keys (this module names them all):
    pd:kv:<request>    JSON: the prefill worker holding the request's KV, its transfer address, the
                       token count and layout fingerprint; expires with the lease
The prefill worker writes the entry when it holds the KV and deletes it when the blocks are freed (pulled,
cancelled or lease expired). A decode worker that finds no entry recomputes the prompt. The entry grants
nothing: a pull needs a ticket signed with the cluster secret (shared/kv/tickets.py).
"""

from __future__ import annotations

import msgspec
from redis.asyncio import Redis

KV_PREFIX = "pd:kv:"


def kv_key(request_id: str) -> str:
    return f"{KV_PREFIX}{request_id}"


class RankKv(msgspec.Struct, frozen=True):
    """One rank of a prefill group as a puller needs it: its KvTransfer address and the KV heads it holds."""

    rank: int
    rpc_address: str  # host:port of that rank's KvTransfer service
    kv_heads: list[int]  # global KV head ids in that rank's pool, in pool order


class GroupKv(msgspec.Struct, frozen=True):
    """The prefill group's KV layout (shared/kv/reslice.py reads it): enough for a decode group of any TP
    to plan which rank each of its ranks pulls which heads from, and to refuse an incompatible model."""

    tp: int
    ranks: list[RankKv]  # by rank, 0..tp-1
    num_layers: int
    num_kv_heads: int  # the model's, all ranks together
    head_dim: int
    dtype: str
    block_size: int
    planes: int = 2  # KVLayout.planes: 2 = K|V, 1 = a latent cache (one replicated "head" on every rank)


class KvLocation(msgspec.Struct, frozen=True, omit_defaults=True):
    request_id: str
    worker_id: str
    rpc_address: str  # host:port of the prefill worker's KvTransfer service (a group's: its leader's)
    num_tokens: int
    fingerprint: str  # KVLayout.fingerprint of the holder: same model KV shape, whatever the TP
    group: GroupKv | None = None  # None: a single-process worker that serves whole-KV pulls (omitted on the wire)


class KvRegistry:
    def __init__(self, redis: Redis, lease_s: float) -> None:
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)

    async def put(self, loc: KvLocation) -> None:
        await self.redis.set(kv_key(loc.request_id), msgspec.json.encode(loc), px=self.lease_ms)

    async def get(self, request_id: str) -> KvLocation | None:
        raw = await self.redis.get(kv_key(request_id))
        return None if raw is None else msgspec.json.decode(raw, type=KvLocation)

    async def delete(self, request_id: str) -> None:
        await self.redis.delete(kv_key(request_id))

    async def count(self) -> int:
        """Live entries (tests and metrics)."""
        return sum([1 async for _ in self.redis.scan_iter(match=f"{KV_PREFIX}*")])
