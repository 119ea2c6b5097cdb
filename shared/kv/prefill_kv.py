"""The prefill worker's KV hand-off, for its R ranks (R = 1: a single worker).

One `KvHandOff` (held.py) owns every held request's state, lease, Redis entry and free; every rank serves pulls of
its KV through its own `RankKv` and transfer server, built from the worker's one `KvTransferSettings`
(endpoints.py). What differs with R is only where the ranks live:

- R = 1: the rank is in-process. Its `RankKv` sends from the engine (EngineKvBlocks: straight from the pool's
  blocks, layer-streamed, or an export copy on CUDA); it is HeldKv's rank link and reports to it directly; its
  server lends the pool in place to a same-host puller when the pool is shared (kv_share_pool).
- R > 1: every rank serves its own KV heads from its pool slice: the leader asks each rank's agent to start its
  server (`kv.serve`, rank_agents.py), tells every rank the held request's block table (the leader's: the
  followers' pools mirror it), and hears each rank's sends as events. The Redis location carries the group's
  record (reslice.group_record), which a puller plans its head pulls from. One ticket covers a decode group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout
from shared.kv.endpoints import kv_server
from shared.kv.held import HeldKv, KvHandOff, Locations
from shared.kv.rank_agents import AgentRankLink, RankServe, encode, on_rank_reports
from shared.kv.rank_held import HeldTable
from shared.kv.ranks import KvRanks
from shared.kv.registry import GroupKv, KvLocation
from shared.kv.reslice import group_record
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.server import KvTransferServer
from shared.kv.transfer.source import EngineKvBlocks
from shared.settings import KvTransferSettings

EngineCall = Callable[[Callable[[Engine], Any]], Awaitable[Any]]


def held_table(engine: Engine, key: str) -> HeldTable:
    """The blocks and token count of a request holding its KV: what a pull of it copies (engine thread)."""
    req = engine.requests[key]
    n = req.num_computed_tokens
    return HeldTable(list(req.block_table[: engine.blocks.blocks_for(n)]), n)


class PrefillKv:
    """The prefill worker's held KV and its ranks' transfer servers (see the module)."""

    def __init__(
        self,
        kv: KvTransferSettings,
        engine: Engine,
        call: EngineCall,
        registry: Locations | None,
        *,
        secret: str,
        model_name: str,
        ranks: KvRanks | None = None,
    ) -> None:
        """engine: the leader's (its layout; its pool for a rank of one); call: runs a function on the engine's
        thread. ranks: the worker group of several this worker leads (None: a worker of one rank)."""
        self.kv, self.engine, self.call = kv, engine, call
        self.secret, self.model_name, self.ranks = secret, model_name, ranks
        self.layout: KVLayout = engine.layout
        self.record: GroupKv | None = None  # a group's, set by start: every location carries it
        self.blocks: EngineKvBlocks | None = None  # a rank of one's engine side (layer streaming watches it)
        self.server: KvTransferServer | None = None  # a rank of one's server
        if ranks is None:
            # one stream for this server's exports and sends, off the engine's compute stream (a no-op on CPU)
            self._stream = SendStream(engine.device)
            self.blocks = EngineKvBlocks(engine, call=call, send_stream=self._stream)
            self.held: KvHandOff = HeldKv(self.blocks, kv.lease_s, registry)
        else:
            links = [AgentRankLink(ranks.agents, r) for r in range(ranks.tp)]
            self.held = KvHandOff(links, self._release, kv.lease_s, registry)

    async def start(self) -> str:
        """Start every rank's transfer server; → the address decode workers dial (the worker's rpc_address)."""
        if isinstance(self.held, HeldKv):  # its rank is in-process
            self.server = kv_server(self.kv, self.held.rank, secret=self.secret, model_name=self.model_name,
                                    port=self.kv.rpc_port, send_stream=self._stream,
                                    shared_pool=self.engine.pool.handle())  # fmt: skip
            return await self.server.start()
        assert self.ranks is not None
        on_rank_reports(self.ranks.agents, self.held)
        job = encode(RankServe(self.kv, self.secret, self.model_name, self.kv.rpc_port))
        addresses = await self.ranks.agents.call_all("kv.serve", dict.fromkeys(range(self.ranks.tp), job))
        model = dataclasses.replace(self.layout, kv_heads=())  # what the record describes: all heads
        self.record = group_record(model, self.ranks.tp, [addresses[r] for r in range(self.ranks.tp)])
        return addresses[0]

    async def close(self) -> None:
        """Stop every rank's server (each waits for its sends in flight), then free whatever is still held."""
        if self.server is not None:
            await self.server.stop()
        if self.ranks is not None:
            await self.ranks.agents.call_all("kv.stop", dict.fromkeys(range(self.ranks.tp)))
        await self.held.release_all()

    def count(self) -> int:
        return self.held.count()

    async def hold(self, key: str, request_id: str, attempt: int, location: KvLocation | None = None) -> bool:
        """HeldKv.hold: a group's ranks get the block table, its location the group's record."""
        if self.ranks is None:
            return await self.held.hold(key, request_id, attempt, location)
        table: HeldTable = await self.call(lambda e: held_table(e, key))
        if location is not None:
            location = msgspec.structs.replace(location, group=self.record, num_tokens=table.num_tokens)
        return await self.held.hold(key, request_id, attempt, location, table)

    async def release(self, key: str) -> None:
        await self.held.release(key)

    async def cancel(self, request_id: str, covers: Callable[[int], bool]) -> int:
        return await self.held.cancel(request_id, covers)

    async def _release(self, key: str) -> None:
        await self.call(lambda e: e.release_kv(key))
