"""Held KV across the ranks of a prefill worker group: every rank serves its own heads, the leader frees.

Two halves, one per side of the group's control channel (the `groups` runtime's rank agents; in-process
calls in tests):

- `RankHeldKv`, on every rank (the leader's too): the `KvSource` of that rank's `KvTransferServer`. It knows
  which keys the leader holds (key → block ids, told by `hold`) and exports, for a Pull, the heads the puller
  names from this rank's pool (a strided slice, copied contiguous). Several pulls of one key may be in flight
  (one per decode rank that takes heads from here). `retire(key)` refuses new pulls of the key and returns
  once those in flight ended: only then may the blocks be freed. Each ended send is reported to the leader.
- `GroupHeldKv`, on the leader: one record per key, the lease timer and the Redis entry (as `HeldKv` for a
  single worker). It frees a key's blocks — every rank retired it first, so no rank is still reading them —
  when the decode group's pulls all ended well (the Pull says how many the group makes), at the first failed
  one (the decode side recomputes), at lease expiry, on a cancel, or at shutdown. A lease expiry or a cancel
  mid-send waits, through `retire`, for the sends in flight: the blocks are never freed under a send.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.engine.block_manager import FREED
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.held import Freed, Locations
from shared.kv.registry import KvLocation

log = logging.getLogger(__name__)

SendReport = Callable[[str, int, bool, int], Awaitable[None]]  # (key, rank, ok, group pulls) → to the leader


@dataclass
class _RankKey:
    block_ids: list[int]  # from `first_block` on
    num_tokens: int
    first_block: int = 0  # the table's leading entries freed behind the sliding window (FREED): not sent
    in_flight: int = 0
    retiring: bool = False
    group_pulls: int = 1  # the transfers the decode group makes (the Pull says), reported with each end
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight


class RankHeldKv:
    """One prefill rank's held KV, served to pulls of head slices (see the module). Runs on its rank's loop."""

    def __init__(self, pool: KVPool, rank: int, report: SendReport) -> None:
        self.pool = pool
        self.rank = rank
        self.report = report
        self._keys: dict[str, _RankKey] = {}

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def held(self) -> list[str]:
        return list(self._keys)

    async def hold(self, key: str, block_ids: list[int], num_tokens: int) -> None:
        if key in self._keys:
            raise ValueError(f"KV of {key!r} is held already on rank {self.rank}")
        first = next((i for i, b in enumerate(block_ids) if b != FREED), len(block_ids))
        self._keys[key] = entry = _RankKey(list(block_ids[first:]), num_tokens, first)
        entry.idle.set()

    async def retire(self, key: str) -> None:
        """No new pull of `key`; returns once the ones in flight ended (then the blocks may be freed)."""
        entry = self._keys.get(key)
        if entry is None:
            return
        entry.retiring = True
        await entry.idle.wait()
        self._keys.pop(key, None)

    # ---- KvSource (the rank's transfer server) --------------------------------------------------------------

    def is_sending(self, key: str, /) -> bool:
        return False  # pulls of one key by several decode ranks run side by side

    async def begin_send(self, key: str, /) -> KVExport:
        return await self.begin_send_heads(key, range(self.layout.num_kv_heads), 1)

    async def begin_send_heads(self, key: str, heads: range, group_pulls: int) -> KVExport:
        """A contiguous copy of `heads` (global ids, all held here) of the key's blocks. KeyError: not held
        (or retiring); ValueError: heads this rank does not hold, or a group_pulls below 1."""
        entry = self._keys.get(key)
        if entry is None or entry.retiring:
            raise KeyError(f"no KV held for request {key!r} on rank {self.rank}")
        held = self.layout.held_kv_heads
        if group_pulls < 1 or not heads or any(h not in held for h in heads):
            raise ValueError(f"rank {self.rank} holds KV heads {list(held)}; asked for {list(heads)}")
        first = held.index(heads.start)
        if held[first : first + len(heads)] != tuple(heads):
            raise ValueError(f"KV heads {list(heads)} are not consecutive in rank {self.rank}'s pool")
        entry.in_flight += 1
        entry.idle.clear()
        entry.group_pulls = group_pulls
        index = torch.tensor(entry.block_ids, dtype=torch.int64, device=self.pool.tensor.device)
        # (L, 2, n, B, h, hd): a head slice of the blocks is strided; the copy makes it one contiguous tensor
        blocks = self.pool.tensor[:, :, :, :, first : first + len(heads)].index_select(2, index).contiguous()
        layout = KVLayout(
            self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.layout.block_size,
            self.layout.dtype, tuple(heads),
        )  # fmt: skip
        return KVExport(layout, entry.num_tokens, blocks, first_block=entry.first_block)

    async def end_send(self, key: str, /, ok: bool) -> None:
        entry = self._keys.get(key)
        if entry is None:
            return
        entry.in_flight -= 1
        pulls = entry.group_pulls
        if entry.in_flight == 0:
            entry.idle.set()
        try:
            await self.report(key, self.rank, ok, pulls)
        except Exception:
            log.exception("reporting the end of a send of %s to the leader failed", key)


class RankLink(Protocol):
    """The leader's handle on one rank's `RankHeldKv` (an agent call in a group, the object itself in-process)."""

    async def hold(self, key: str, block_ids: list[int], num_tokens: int) -> None: ...

    async def retire(self, key: str) -> None: ...


@dataclass
class _GroupRecord:
    key: str
    timer: asyncio.TimerHandle | None
    ended_ok: int = 0
    freeing: bool = False


class GroupHeldKv:
    """The prefill leader's held KV of a group (see the module). Methods run on the leader's loop."""

    def __init__(
        self,
        ranks: list[RankLink],
        release: Callable[[str], Awaitable[None]],
        lease_s: float,
        registry: Locations | None = None,
    ) -> None:
        """ranks: every rank, the leader's own included. release(key): free the key's engine blocks (the
        leader's engine; the group's ranks mirror its block tables)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.ranks = ranks
        self.release = release
        self.lease_s = lease_s
        self.registry = registry
        self.freed: Counter[Freed] = Counter()
        self._records: dict[str, _GroupRecord] = {}
        self._freeing: set[asyncio.Task[None]] = set()

    def count(self) -> int:
        return len(self._records)

    async def hold(self, key: str, block_ids: list[int], num_tokens: int, location: KvLocation | None = None) -> bool:
        """Tell every rank, arm the lease, write the location. False (blocks freed) if a step of it failed."""
        if key in self._records:
            raise ValueError(f"KV of {key!r} is held already")
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._lease_expired, key)
        self._records[key] = _GroupRecord(key, timer)
        try:
            await asyncio.gather(*(r.hold(key, block_ids, num_tokens) for r in self.ranks))
            if self.registry is not None and location is not None:
                await self.registry.put(location)
        except Exception as exc:
            log.warning("could not hold the KV of %s on every rank (%s); decode will recompute", key, exc)
            await self._free(key, Freed.NOT_RECORDED)
            return False
        return True

    async def send_ended(self, key: str, rank: int, ok: bool, group_pulls: int) -> None:
        """A rank's report: one send of `key` ended. All the group's pulls done, or one failed: free."""
        record = self._records.get(key)
        if record is None or record.freeing:
            return
        if not ok:
            log.warning("a KV send of %s from rank %d failed; freeing it on every rank", key, rank)
            await self._free(key, Freed.SEND_FAILED)
            return
        record.ended_ok += 1
        if record.ended_ok >= group_pulls:
            await self._free(key, Freed.PULLED)

    async def cancel(self, key: str) -> None:
        await self._free(key, Freed.CANCELLED)

    async def release_all(self) -> None:
        await asyncio.gather(*(self._free(k, Freed.SHUTDOWN) for k in list(self._records)))
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)

    def _lease_expired(self, key: str) -> None:
        record = self._records.get(key)
        if record is None or record.freeing:
            return
        record.timer = None
        log.info("KV lease of %s expired; freeing it once no rank is sending it", key)
        task = asyncio.create_task(self._free(key, Freed.LEASE_EXPIRED))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    async def _free(self, key: str, why: Freed) -> None:
        """Retire the key on every rank (each waits for its sends in flight), then free the blocks, once."""
        record = self._records.get(key)
        if record is None or record.freeing:
            return
        record.freeing = True
        if record.timer is not None:
            record.timer.cancel()
        results = await asyncio.gather(*(r.retire(key) for r in self.ranks), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):  # a dead rank takes its group down (issue 13, 6)
                log.warning("rank %d could not retire the KV of %s: %r", rank, key, result)
        del self._records[key]
        self.freed[why] += 1
        try:
            await self.release(key)
        except Exception:
            log.exception("releasing the KV of %s failed", key)
        if self.registry is not None:
            try:
                await self.registry.delete(key)
            except Exception as exc:
                log.warning("could not delete the KV location of %s: %s", key, exc)
