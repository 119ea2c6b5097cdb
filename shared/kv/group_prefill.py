"""A prefill worker group's held KV, as its worker sees it: each rank serves its own KV heads.

`PrefillGroupKv` gives the prefill worker the calls it makes of `HeldKv` (hold, release, cancel, release_all,
count, layout) for a group whose ranks hold KV head slices (tp > 1):

- `start`: every rank starts its own transfer server over its pool slice (agent call `kv.serve`,
  rank_agents.py); the addresses make the group record (reslice.group_record) that every location carries.
- `hold`: the held request's blocks (the leader's block table: the followers' pools mirror it) are told to
  every rank (`kv.hold`), the lease armed and the location written with the group record, in `GroupHeldKv`.
  One ticket covers the group: a decode rank's pull ticket names its group, which every prefill rank checks.
- each rank reports each ended send (the event `kv.send_ended`, its own rank's too); `GroupHeldKv` frees once
  the decode group's pulls all ended well, at the first failed one, on lease expiry or cancel: every rank
  retires the key first (waiting for its sends in flight), then the leader's engine frees the blocks, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout
from shared.kv.group_held import GroupHeldKv
from shared.kv.held import Locations
from shared.kv.rank_agents import SEND_ENDED, RankServe
from shared.kv.registry import GroupKv, KvLocation
from shared.kv.reslice import group_record
from shared.parallel.agents import GroupAgents

EngineCall = Callable[[Callable[[Engine], Any]], Awaitable[Any]]


class AgentRankLink:
    """GroupHeldKv's handle on one rank's RankHeldKv, through the leader's agents."""

    def __init__(self, agents: GroupAgents, rank: int) -> None:
        self.agents, self.rank = agents, rank

    async def hold(self, key: str, block_ids: list[int], num_tokens: int) -> None:
        await self.agents.call(self.rank, "kv.hold", {"key": key, "block_ids": block_ids, "num_tokens": num_tokens})

    async def retire(self, key: str) -> None:
        await self.agents.call(self.rank, "kv.retire", {"key": key})


def held_blocks(engine: Engine, key: str) -> tuple[list[int], int]:
    """(the block ids, the token count) of a request holding its KV: what a pull of it copies (engine thread)."""
    req = engine.requests[key]
    n = req.num_computed_tokens
    return list(req.block_table[: engine.blocks.blocks_for(n)]), n


class PrefillGroupKv:
    """The prefill leader's held KV when its group's ranks hold KV head slices (see the module)."""

    def __init__(
        self, agents: GroupAgents, tp: int, layout: KVLayout, call: EngineCall, lease_s: float, registry: Locations
    ) -> None:
        """layout: the leader's pool's (its heads); call: runs a function on the engine's thread."""
        self.agents = agents
        self.tp = tp
        self.model_layout = dataclasses.replace(layout, kv_heads=())  # what the record describes: all heads
        self._layout = layout
        self.call = call
        self.record: GroupKv | None = None  # set by start
        self.group = GroupHeldKv([AgentRankLink(agents, r) for r in range(tp)], self._release, lease_s, registry)
        self._attempts: dict[str, tuple[str, int]] = {}  # key → (request id, attempt), for cancels

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def freed(self):
        return self.group.freed

    async def start(self, serve: RankServe) -> str:
        """Start every rank's transfer server; → the leader's address (the worker's rpc_address)."""
        self.agents.on_event(SEND_ENDED, self._send_ended)
        addresses = await self.agents.call_all("kv.serve", dict.fromkeys(range(self.tp), serve))
        self.record = group_record(self.model_layout, self.tp, [addresses[r] for r in range(self.tp)])
        return addresses[0]

    async def stop(self) -> None:
        await self.agents.call_all("kv.stop", dict.fromkeys(range(self.tp)))

    def count(self) -> int:
        return self.group.count()

    async def hold(self, key: str, request_id: str, attempt: int, location: KvLocation | None = None) -> bool:
        """As HeldKv.hold: False (blocks freed) when a rank could not hold it or the location was not written."""
        block_ids, num_tokens = await self.call(lambda e: held_blocks(e, key))
        if location is not None:
            location = msgspec.structs.replace(location, group=self.record, num_tokens=num_tokens)
        self._attempts[key] = (request_id, attempt)
        held = await self.group.hold(key, block_ids, num_tokens, location)
        if not held:
            self._attempts.pop(key, None)
        return held

    async def release(self, key: str) -> None:
        await self.group.cancel(key)

    async def cancel(self, request_id: str, covers: Callable[[int], bool]) -> int:
        found = [k for k, (rid, attempt) in self._attempts.items() if rid == request_id and covers(attempt)]
        await asyncio.gather(*(self.group.cancel(k) for k in found))
        return len(found)

    async def release_all(self) -> None:
        await self.group.release_all()

    async def _send_ended(self, rank: int, payload: tuple[str, bool, int]) -> None:
        key, ok, group_pulls = payload
        await self.group.send_ended(key, rank, ok, group_pulls)

    async def _release(self, key: str) -> None:
        self._attempts.pop(key, None)
        await self.call(lambda e: e.release_kv(key))
