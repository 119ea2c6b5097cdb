"""A prefill (or mixed) worker's announcements of the prefix-cache blocks it holds, for KV-aware routing
(docs/architecture.md): the gateways route a prompt to the worker holding its prefix.

Every ANNOUNCE_S the engine thread hands over the block hashes its prefix cache stored and removed since the last
call (Engine.prefix_cache_events); they go out on `pd.kv.blocks.<model>.<worker>` as numbered updates
(KvBlockEvents: 1, 2, ... per incarnation `epoch`; at most KV_HASHES_PER_MESSAGE hashes each). When the
engine's event log overflowed, the update is a snapshot of every held hash instead (KvBlockSnapshot, in the
numbering). A gateway that is out of step asks on `pd.kv.snapshot.<model>`: the workers it names answer to its
reply subject with their snapshot after their last update. One lock orders taking changes from the engine and
publishing them, so the numbers follow the engine's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.messages import (
    KV_HASHES_PER_MESSAGE,
    KvBlockEvents,
    KvBlockSnapshot,
    KvSnapshotRequest,
    decode_or_drop,
    encode,
    kv_blocks_subject,
    kv_snapshot_subject,
)

log = logging.getLogger(__name__)
ANNOUNCE_S = 0.1  # how often the engine's block changes are taken and sent
T = TypeVar("T")


class PrefixCacheEvents(Protocol):
    stored: list[int]
    removed: list[int]
    overflowed: bool


class PrefixCacheEngine(Protocol):
    """What the announcer needs of the engine (shared/engine/engine.py's prefix cache), on its thread only."""

    def prefix_cache_events(self) -> PrefixCacheEvents: ...

    def prefix_cache_hashes(self) -> list[int]: ...


def announces_blocks(engine: Any) -> bool:
    """Whether the engine has a prefix cache whose blocks can be announced."""
    return callable(getattr(engine, "prefix_cache_events", None))


def take_changes(engine: PrefixCacheEngine) -> tuple[PrefixCacheEvents, list[int] | None]:
    """On the engine thread: the block changes since the last call, and every held hash when the change log
    overflowed (the changes are then incomplete)."""
    events = engine.prefix_cache_events()
    return events, engine.prefix_cache_hashes() if events.overflowed else None


def take_all(engine: PrefixCacheEngine) -> tuple[PrefixCacheEvents, list[int]]:
    """On the engine thread: the changes since the last call, then every held hash (after them)."""
    return engine.prefix_cache_events(), engine.prefix_cache_hashes()


class EngineCall(Protocol):
    """Runs a function on the engine thread and returns its result (AsyncEngine.call)."""

    def __call__(self, fn: Callable[[Any], T], /) -> Awaitable[T]: ...


class BlockAnnouncer:
    def __init__(
        self,
        nc: NATS,
        call: EngineCall,
        model: str,
        worker_id: str,
        block_size: int,
    ) -> None:
        self.nc, self.call = nc, call
        self.model, self.worker_id, self.block_size = model, worker_id, block_size
        self.epoch = uuid.uuid4().hex[:12]  # this incarnation: a restart numbers its updates from 1 again
        self.seq = 0  # the last update sent
        self.subject = kv_blocks_subject(model, worker_id)
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self.nc.subscribe(kv_snapshot_subject(self.model), cb=self._on_request)

    async def run(self) -> None:
        """Forever: announce the engine's block changes every ANNOUNCE_S; a round NATS cannot take is retried."""
        while True:
            try:
                await self.announce()
            except Exception as exc:  # gateways notice the gap (or the next beat's number) and ask for a snapshot
                log.warning("announcing prefix-cache blocks failed: %s", exc)
            await asyncio.sleep(ANNOUNCE_S)

    async def announce(self) -> None:
        async with self._lock:
            events, everything = await self.call(take_changes)
            if everything is not None:
                self.seq += 1
                await self._publish_snapshot(self.subject, everything)
            else:
                await self._publish_events(events.removed, events.stored)

    async def _on_request(self, msg: Msg) -> None:
        request = decode_or_drop(msg.data, KvSnapshotRequest, msg.subject)
        if request is None or not msg.reply or not request.names(self.worker_id):
            return
        with contextlib.suppress(Exception):  # the gateway asks again
            async with self._lock:
                events, everything = await self.call(take_all)
                await self._publish_events(events.removed, events.stored)  # everyone else's copy stays in step
                await self._publish_snapshot(msg.reply, everything)

    async def _publish_events(self, removed: list[int], stored: list[int]) -> None:
        """Removed first, then stored, in numbered messages of at most KV_HASHES_PER_MESSAGE hashes."""
        while removed or stored:
            room = KV_HASHES_PER_MESSAGE
            gone, removed = removed[:room], removed[room:]
            room -= len(gone)
            new, stored = stored[:room], stored[room:]
            self.seq += 1
            update = KvBlockEvents(self.worker_id, self.epoch, self.seq, self.block_size, removed=gone, stored=new)
            await self.nc.publish(self.subject, encode(update))

    async def _publish_snapshot(self, subject: str, hashes: list[int]) -> None:
        """The snapshot after update `seq`, in parts of at most KV_HASHES_PER_MESSAGE hashes (one when empty)."""
        parts = max(1, -(-len(hashes) // KV_HASHES_PER_MESSAGE))
        for part in range(parts):
            chunk = hashes[part * KV_HASHES_PER_MESSAGE : (part + 1) * KV_HASHES_PER_MESSAGE]
            snapshot = KvBlockSnapshot(
                self.worker_id, self.epoch, self.seq, self.block_size, part=part, parts=parts, hashes=chunk
            )
            await self.nc.publish(subject, encode(snapshot))
