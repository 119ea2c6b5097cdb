"""One rank's side of the KV hand-off: what this rank's transfer server sends (its `KvSource`).

Every worker is a group of R ranks (R = 1 for a single worker) and every rank runs a `RankKv`: the leader's
`HeldKv` (held.py) tells it, through its rank link, which keys are held (`hold`), when to stop serving one
(`close`) and when the blocks are about to be freed (`retire`: returns once no send of the key is in flight
on this rank). The rank reports each send's start and end to the leader (`SendReports`: in-process for the
leader's own rank, the group's events channel for a follower); the leader alone decides when the blocks go.

Where a rank's KV comes from:
- the leader of a group of one: the engine (`KvBlocks`, e.g. EngineKvBlocks: a send straight from the pool's
  blocks, a layer-streamed send, or an export copy on CUDA);
- a rank of a group of several: its own pool slice, read at the block ids the leader's hold names (`HeldTable`:
  the followers' pools mirror the leader's block tables).

Per key this rank keeps one `_Entry`: OPEN (pulls accepted) or CLOSED (none; the leader is freeing it), the
sends in flight (one whole-KV send, or any number of head-slice sends side by side: a decode group's ranks
each taking their heads) and, for slices, the one export they are all cut from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from shared.engine.block_manager import FREED
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.source import AlreadySending, KvBlocks, Outgoing

log = logging.getLogger(__name__)


class SendOutcome(enum.Enum):
    SENT = "sent"
    FAILED = "failed"  # the send started and failed: the puller's copy is unusable
    NOT_STARTED = "not_started"  # the export raised: nothing went out


class SendReports(Protocol):
    """Where a rank reports its sends (the leader's HeldKv, directly or through the group's events)."""

    async def send_began(self, key: str, rank: int) -> None: ...

    async def send_ended(self, key: str, rank: int, outcome: SendOutcome, group_pulls: int) -> None: ...


class HeldTable(msgspec.Struct, frozen=True):
    """What a rank of a group of several serves for a key: the leader's block table (the followers' pools
    mirror it) and the token count. A group of one reads its engine instead (None)."""

    block_ids: list[int]
    num_tokens: int


class KeyState(enum.Enum):
    OPEN = "open"  # pulls accepted
    CLOSED = "closed"  # the leader is freeing the key: no new pull; sends in flight run to their end


@dataclass
class _Entry:
    table: HeldTable | None
    state: KeyState = KeyState.OPEN
    sends: int = 0  # in flight
    whole: bool = False  # the send in flight is a whole-KV one (it excludes every other)
    group_pulls: int = 1  # the transfers the decode group makes (the last slice's Pull says), reported
    export: asyncio.Task[Outgoing] | None = None  # the one export the slices are cut from (kept between them)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight


class RankKv:
    """One rank's held KV, served to its transfer server (see the module). Runs on its rank's loop."""

    def __init__(
        self,
        rank: int,
        reports: SendReports | None = None,
        *,
        blocks: KvBlocks | None = None,
        pool: KVPool | None = None,
        send_stream: SendStream | None = None,
    ) -> None:
        """reports: the leader's (None: given later, `report_to`). blocks: the engine side (a group of one);
        pool: this rank's pool slice (a group of several). send_stream: the stream this rank's head slices are
        cut on, shared with its server (send_stream.py: on CUDA, off the compute stream; None: none, as on CPU)."""
        if (blocks is None) == (pool is None):
            raise ValueError("a rank serves either its engine's blocks or its pool slice")
        self.rank = rank
        self.reports = reports
        self.blocks = blocks
        self.pool = pool
        self.send_stream = send_stream or SendStream("cpu")
        self._keys: dict[str, _Entry] = {}

    def report_to(self, reports: SendReports) -> None:
        self.reports = reports

    @property
    def layout(self) -> KVLayout:
        source = self.blocks if self.blocks is not None else self.pool
        assert source is not None
        return source.layout

    def held(self) -> list[str]:
        return list(self._keys)

    # ---- the leader's side (its rank link) ---------------------------------------------------------------------

    async def hold(self, key: str, table: HeldTable | None = None) -> None:
        if key in self._keys:
            raise ValueError(f"KV of {key!r} is held already on rank {self.rank}")
        if (table is None) != (self.pool is None):
            raise ValueError(f"rank {self.rank} needs {'a' if self.pool is not None else 'no'} block table")
        self._keys[key] = entry = _Entry(table)
        entry.idle.set()

    async def close(self, key: str, stop_why: str | None = None) -> None:
        """No new pull of `key`. stop_why: a layer-streamed send of it in flight fails now, for that reason,
        instead of running to its end (a release or a cancel: nobody wants the KV; a lease's end lets it finish)."""
        entry = self._keys.get(key)
        if entry is None:
            return
        entry.state = KeyState.CLOSED
        stop = getattr(self.blocks, "stop_stream", None)
        if stop_why is not None and entry.sends and stop is not None:
            stop(key, stop_why)

    async def retire(self, key: str, wait: bool = True) -> None:
        """Close `key` and forget it once the sends in flight ended (at once with wait=False: teardown, after
        the transfer server stopped); only then may the blocks be freed."""
        entry = self._keys.get(key)
        if entry is None:
            return
        await self.close(key, None if wait else "the worker is stopping")
        if wait:
            await entry.idle.wait()
        if self._keys.get(key) is entry:
            del self._keys[key]

    # ---- KvSource (this rank's transfer server) --------------------------------------------------------------

    def is_sending(self, key: str, /) -> bool:
        """A whole-KV send is in flight (slice sends of a decode group's ranks may run side by side)."""
        entry = self._keys.get(key)
        return entry is not None and entry.whole

    async def begin_send(self, key: str, /) -> Outgoing:
        """The key's whole KV to send (a copy, or the blocks themselves). KeyError: not held here (or closed);
        AlreadySending: a send of it is in flight."""
        if self.pool is not None:  # a pool slice serves heads: a whole pull is one of all heads (if held here)
            return await self.begin_send_heads(key, range(self.layout.num_kv_heads), 1)
        entry = self._open(key)
        if entry.sends:
            raise AlreadySending(f"request {key!r} is already being pulled")
        entry.whole = True
        await self._began(key, entry)
        try:
            return await self._export(key, entry)
        except BaseException:
            await self._ended(key, entry, SendOutcome.NOT_STARTED)
            raise

    async def begin_send_heads(self, key: str, heads: range, group_pulls: int) -> KVExport:
        """A contiguous copy of KV heads `heads` (global ids, all held here) of the key's KV, for one of a decode
        group's `group_pulls` transfers. KeyError: not held here (or closed); AlreadySending: a whole-KV send is
        in flight; ValueError: heads this rank does not hold, or group_pulls below 1."""
        entry = self._open(key)
        if entry.whole:
            raise AlreadySending(f"request {key!r} is already being pulled whole")
        positions = self._positions(heads, group_pulls)
        entry.group_pulls = group_pulls
        await self._began(key, entry)
        try:
            if entry.export is None:  # the first slice exports; the others wait for the same export
                entry.export = asyncio.ensure_future(self._export(key, entry))
            full = await asyncio.shield(entry.export)
            with self.send_stream.exporting():
                return _cut(key, full, heads, positions)
        except BaseException:
            entry.export = None
            await self._ended(key, entry, SendOutcome.NOT_STARTED)
            raise

    async def end_send(self, key: str, /, ok: bool) -> None:
        """The send is over (sent, or failed): reported to the leader, which decides what becomes of the KV."""
        entry = self._keys.get(key)
        if entry is not None and entry.sends:
            await self._ended(key, entry, SendOutcome.SENT if ok else SendOutcome.FAILED)

    # ---- inside ------------------------------------------------------------------------------------------------

    def _open(self, key: str) -> _Entry:
        entry = self._keys.get(key)
        if entry is None or entry.state is KeyState.CLOSED:
            where = "" if self.pool is None else f" on rank {self.rank}"
            raise KeyError(f"no KV held for request {key!r}{where}")
        return entry

    def _positions(self, heads: range, group_pulls: int) -> range:
        """Where `heads` (global ids) lie in this rank's pool. ValueError: not all held here, or not in a row."""
        held = self.layout.held_kv_heads
        if group_pulls < 1 or not heads or heads.start < 0 or any(h not in held for h in heads):
            raise ValueError(
                f"rank {self.rank} holds KV heads {list(held)}; asked for {list(heads)} (of {group_pulls} pulls)"
            )
        first = held.index(heads.start)
        if tuple(held[first : first + len(heads)]) != tuple(heads):
            raise ValueError(f"KV heads {list(heads)} are not consecutive in rank {self.rank}'s pool")
        return range(first, first + len(heads))

    async def _began(self, key: str, entry: _Entry) -> None:
        entry.sends += 1
        entry.idle.clear()
        await self._report(lambda r: r.send_began(key, self.rank))

    async def _ended(self, key: str, entry: _Entry, outcome: SendOutcome) -> None:
        entry.sends -= 1
        pulls = 1 if entry.whole else entry.group_pulls
        if not entry.sends:
            entry.whole = False
            entry.idle.set()
        await self._report(lambda r: r.send_ended(key, self.rank, outcome, pulls))

    async def _report(self, report: Callable[[SendReports], Awaitable[None]]) -> None:
        if self.reports is None:
            raise RuntimeError(f"rank {self.rank} has no leader to report its sends to")
        try:
            await report(self.reports)
        except Exception:  # a leader that is gone takes its group down anyway
            log.exception("reporting a KV send to the leader failed")

    async def _export(self, key: str, entry: _Entry) -> Outgoing:
        if entry.table is None:
            assert self.blocks is not None
            return await self.blocks.export_kv(key)
        assert self.pool is not None
        first = next((i for i, b in enumerate(entry.table.block_ids) if b != FREED), len(entry.table.block_ids))
        return PoolKv(self.layout, entry.table.num_tokens, self.pool, entry.table.block_ids[first:], "direct",
                      first_block=first)  # fmt: skip


def _cut(key: str, kv: Outgoing, heads: range, positions: range) -> KVExport:
    """A contiguous copy of pool positions `positions` (global heads `heads`) of the KV: straight from the pool's
    blocks for a plan of them (one copy), from the tensor for an export, after one gather for a layer stream."""
    if kv.parts:  # kv_groups.py: a hybrid model's flat export of several groups
        raise ValueError(
            f"the KV of {key!r} lies in {len(kv.parts)} KV cache groups (full and sliding layers): a decode "
            "worker group's head slices of it are not supported yet; pull it whole into a single-rank engine"
        )
    layout = dataclasses.replace(kv.layout, kv_heads=tuple(heads))  # its planes too (a latent stays one)
    if type(kv) is PoolKv:
        pool = kv.pool.tensor  # (L, P, N, B, h, hd): the slice is strided; the copy makes it one tensor
        index = torch.tensor(kv.block_ids, dtype=torch.int64, device=pool.device)
        blocks = pool[:, :, :, :, positions.start : positions.stop].index_select(2, index).contiguous()
        return KVExport(layout, kv.num_tokens, blocks, first_block=kv.first_block)
    if isinstance(kv, PoolKv):  # a layer stream: gathered whole once it is complete
        whole = torch.empty(kv.shape, dtype=kv.layout.torch_dtype, device=kv.pool.tensor.device)
        kv.copy_into(whole)
        kv = KVExport(kv.layout, kv.num_tokens, whole, first_block=kv.first_block)
    blocks = kv.blocks[:, :, :, :, positions.start : positions.stop].contiguous()
    return KVExport(layout, kv.num_tokens, blocks, first_block=kv.first_block)
