"""Every request's KV a prefill worker holds for a pull: one record per attempt key, HELD → SENDING → FREED.

A worker is a group of R ranks (R = 1: a single worker) and this is its one hand-off, on the leader:
`KvHandOff` (`HeldKv` is it for one rank over its engine's blocks, in-process). It owns, per key, the state, the
lease timer and the Redis location entry, and it frees the engine's blocks exactly once. The prefill worker
calls `hold`, `release`, `cancel` and `release_all`. Each rank's transfer server sends from that rank's `RankKv`
(rank_held.py), which the leader reaches through a rank link (the `RankKv` itself in-process; an agent call for
a follower) and which reports every send's start and end here (`send_began` / `send_ended`). The lease timer and
the Redis entry's TTL are both `lease_s`, started by `hold`.

States (blocks owner; lease timer; Redis entry → exits):
- HELD: this worker, blocks pinned in the engine, every rank serving them; timer running; entry written
  (TTL = lease). → SENDING when a rank reports a send; → FREED on lease expiry, cancel, release, release_all.
- SENDING: the sends (copies of the blocks are on the wire; the blocks stay pinned). A lease expiry, a cancel,
  a release or a failed send *closes* the record (`closing`: why it will be freed): every rank refuses new
  pulls, the timer stops, and the blocks are freed once the sends in flight ended. → HELD when the sends
  ended with the decode group's pulls not all done (a decode group's ranks pull their heads one by one, or an
  export raised: nothing went out); → FREED when the group's pulls all ended well (PULLED, even if the lease
  ran out meanwhile), or when a closed record's last send ended.
- FREED: the engine (its blocks released exactly once, after every rank retired the key: no rank still reads
  them); timer cancelled; entry deleted (its TTL if the delete fails). No record is left: `state` answers FREED
  for any key it does not hold.

A failed send frees the blocks (as a pulled one does): the puller's copy is unusable and its pair dropped, so
decode recomputes. How many transfers make a complete pull: 1 for a whole-KV one, else what the Pull says (a
decode group's plan, reslice.group_pulls). No call here waits for a send: a free that must wait for one
happens when that send's end is reported (a follower's unreported send: its rank's `retire` waits for it).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.rank_held import HeldTable, RankKv, SendOutcome
from shared.kv.registry import KvLocation
from shared.kv.transfer.source import KvBlocks, Outgoing

log = logging.getLogger(__name__)


class HeldState(enum.Enum):
    HELD = "held"  # pinned, waiting for a pull
    SENDING = "sending"  # a pull's send is in flight
    FREED = "freed"  # released (or never held here): no record


class Freed(enum.Enum):
    """Why a record's blocks were freed (logs and `HeldKv.freed`)."""

    PULLED = "pulled"
    SEND_FAILED = "send_failed"
    LEASE_EXPIRED = "lease_expired"
    CANCELLED = "cancelled"  # a Cancel or the worker's own release
    NOT_RECORDED = "not_recorded"  # a rank or the Redis entry could not take it: nobody could find the KV
    SHUTDOWN = "shutdown"


class Locations(Protocol):
    """Where held KV is announced (KvRegistry: Redis, entries expiring with the lease)."""

    async def put(self, loc: KvLocation) -> None: ...

    async def delete(self, request_id: str) -> None: ...


class RankLink(Protocol):
    """The leader's handle on one rank's RankKv: the object itself in-process, agent calls for a follower."""

    async def hold(self, key: str, table: HeldTable | None = None) -> None: ...

    async def close(self, key: str, stop_why: str | None = None) -> None: ...

    async def retire(self, key: str, wait: bool = True) -> None: ...


@dataclass
class _Record:
    key: str
    request_id: str
    attempt: int
    timer: asyncio.TimerHandle | None  # None once the lease ran out or the record closed
    state: HeldState = HeldState.HELD
    closing: Freed | None = None  # why it will be freed once no send is in flight (set once)
    sending: int = 0  # sends in flight, as the ranks reported them
    sent: int = 0  # sends that ended well
    group_pulls: int = 1  # transfers that make a complete pull (the ranks report what the Pulls said)


class KvHandOff:
    """A worker's held KV across its R ranks (see the module's table). Methods run on the leader's loop."""

    def __init__(
        self,
        ranks: Sequence[RankLink],
        release: Callable[[str], Awaitable[None]],
        lease_s: float,
        registry: Locations | None = None,
    ) -> None:
        """ranks: every rank, the leader's own first. release(key): free the key's engine blocks (the leader's
        engine; a group's followers mirror its block tables). lease_s: how long KV waits for a pull. registry:
        where `hold` writes each location and the free deletes it; None = nobody looks KV up (tests, benchmarks)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        if not ranks:
            raise ValueError("a worker has at least one rank")
        self.ranks = list(ranks)
        self.release_blocks = release
        self.lease_s = lease_s
        self.registry = registry
        self.freed: Counter[Freed] = Counter()  # records freed so far, by why
        self._records: dict[str, _Record] = {}  # HELD or SENDING, by attempt key
        self._tasks: set[asyncio.Task[None]] = set()  # frees and closes started from a callback

    def state(self, key: str) -> HeldState:
        record = self._records.get(key)
        return HeldState.FREED if record is None else record.state

    def count(self) -> int:
        """Requests held or being sent (the heartbeat's `held_kv`)."""
        return len(self._records)

    def keys(self) -> list[str]:
        return list(self._records)

    # ---- the prefill worker's side -------------------------------------------------------------------------

    async def hold(
        self,
        key: str,
        request_id: str,
        attempt: int,
        location: KvLocation | None = None,
        table: HeldTable | None = None,
    ) -> bool:
        """Take over a finished request's pinned blocks: every rank told (`table`: what a group's ranks read),
        HELD, lease timer armed, `location` written. False when a rank or the registry could not take it
        (logged; the blocks are freed at once: no decode worker could find them, it recomputes) or a cancel
        freed the key meanwhile. Raises ValueError for a key held already."""
        if key in self._records:
            raise ValueError(f"KV of {key!r} is held already")
        if self.registry is not None and location is None:
            raise ValueError("a HeldKv with a registry needs the location to write")
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._lease_expired, key)
        record = self._records[key] = _Record(key, request_id, attempt, timer)
        try:
            for result in await self._each(lambda rank: rank.hold(key, table)):
                if isinstance(result, BaseException):
                    raise result
            if self.registry is not None and location is not None and self._records.get(key) is record:
                await self.registry.put(location)
        except Exception as exc:  # a rank gone, Redis unreachable
            log.warning("could not record the KV location of %s (%s); decode will recompute", key, exc)
            await self._close(record, Freed.NOT_RECORDED)
            return False
        if self._records.get(key) is not record:  # cancelled during the write: its delete may have come first
            await self._delete_entry(key)
            return False
        return True

    async def release(self, key: str, why: Freed = Freed.CANCELLED) -> None:
        """Free a HELD key now; a SENDING one when its sends end. No-op for a key not held."""
        record = self._records.get(key)
        if record is not None:
            await self._close(record, why, stop=True)

    async def cancel(self, request_id: str, covers: Callable[[int], bool]) -> int:
        """`release` every key of `request_id` whose attempt `covers` accepts; how many it found."""
        found = [r for r in self._records.values() if r.request_id == request_id and covers(r.attempt)]
        for record in found:
            await self._close(record, Freed.CANCELLED, stop=True)
        return len(found)

    async def release_all(self) -> None:
        """Free every record now, SENDING ones too (teardown, after the transfer servers stopped: their stop
        waits for the sends in flight, so none is left mid-send), and wait for frees already started."""
        for record in list(self._records.values()):
            record.closing = record.closing or Freed.SHUTDOWN
            await self._free(record, wait=False)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the ranks' reports (SendReports) ---------------------------------------------------------------------

    async def send_began(self, key: str, rank: int) -> None:
        record = self._records.get(key)
        if record is not None:
            record.sending += 1
            record.state = HeldState.SENDING

    async def send_ended(self, key: str, rank: int, outcome: SendOutcome, group_pulls: int) -> None:
        record = self._records.get(key)
        if record is None:
            return
        record.sending = max(0, record.sending - 1)
        if outcome is SendOutcome.SENT:
            record.sent += 1
            record.group_pulls = group_pulls
            if record.sent >= group_pulls and record.closing in (None, Freed.LEASE_EXPIRED):
                record.closing = Freed.PULLED  # the pull completed: the lease's end no longer matters
        elif outcome is SendOutcome.FAILED and record.closing is None:
            log.warning("a KV send of %s from rank %d failed; freeing it", key, rank)
            await self._close(record, Freed.SEND_FAILED)
            return
        await self._settle(record)

    # ---- closing and freeing -------------------------------------------------------------------------------------

    async def _close(self, record: _Record, why: Freed, stop: bool = False) -> None:
        """No new pull of the record (every rank told), its timer stopped; freed now if no send is in flight.
        stop: a release or cancel, which also stops a layer-streamed send in flight (the KV is not wanted)."""
        first = record.closing is None
        record.closing = record.closing or why
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        if record.sending and (first or stop):
            stop_why = f"its KV was released ({why.value})" if stop else None
            await self._each(lambda rank: rank.close(record.key, stop_why))
        await self._settle(record)

    async def _settle(self, record: _Record) -> None:
        """After an event: free a closed record whose sends all ended, else HELD or SENDING as they are."""
        if self._records.get(record.key) is not record:
            return
        if record.closing is not None and not record.sending:
            await self._free(record)
        else:
            record.state = HeldState.SENDING if record.sending else HeldState.HELD

    async def _free(self, record: _Record, wait: bool = True) -> None:
        """Forget the record (nothing else frees it), retire the key on every rank (each waits for a send of it
        still in flight there), then the engine's blocks and the Redis entry: once."""
        if self._records.get(record.key) is not record:
            return
        del self._records[record.key]
        if record.timer is not None:
            record.timer.cancel()
        why = record.closing or Freed.CANCELLED
        self.freed[why] += 1
        for rank, result in enumerate(await self._each(lambda r: r.retire(record.key, wait))):
            if isinstance(result, BaseException):  # a dead rank takes its group down (issue 13, 6)
                log.warning("rank %d could not retire the KV of %s: %r", rank, record.key, result)
        log.debug("freeing the KV of %s (%s)", record.key, why.value)
        try:
            await self.release_blocks(record.key)
        except Exception:
            log.exception("releasing the KV of %s failed", record.key)
        await self._delete_entry(record.key)

    async def _each(self, call: Callable[[RankLink], Awaitable[None]]) -> list[BaseException | None]:
        """`call` on every rank at once; what each raised (None: it returned). One rank: awaited in place (no task
        for the single worker's in-process rank)."""
        if len(self.ranks) == 1:
            try:
                await call(self.ranks[0])
            except Exception as exc:
                return [exc]
            return [None]
        results = await asyncio.gather(*(call(r) for r in self.ranks), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    def _lease_expired(self, key: str) -> None:
        record = self._records.get(key)
        if record is None:
            return
        record.timer = None
        if record.state is HeldState.SENDING:  # the sends own the blocks: freed when they end
            log.info("KV lease of %s expired during its send; freeing it when the send ends", key)
        else:
            log.warning("KV lease of %s expired before any pull; freeing its blocks", key)
        self._spawn(self._close(record, Freed.LEASE_EXPIRED))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _delete_entry(self, key: str) -> None:
        if self.registry is None:
            return
        try:
            await self.registry.delete(key)
        except Exception as exc:  # the entry's TTL removes it anyway
            log.warning("could not delete the KV location of %s: %s", key, exc)


class HeldKv(KvHandOff):
    """A worker of one rank: the hand-off over its engine's blocks, its rank (`rank`) in-process, reporting here
    directly. It is also that rank's KvSource (what its transfer server sends from): those calls go to the rank."""

    def __init__(self, blocks: KvBlocks, lease_s: float, registry: Locations | None = None) -> None:
        """blocks: the engine side (export, free). lease_s: how long KV waits for a pull. registry: where
        `hold` writes each location and the free deletes it; None = nobody looks KV up (tests, benchmarks)."""
        self.rank = RankKv(0, blocks=blocks)
        super().__init__([self.rank], blocks.release_kv, lease_s, registry)
        self.rank.report_to(self)

    @property
    def layout(self) -> KVLayout:
        return self.rank.layout

    def is_sending(self, key: str, /) -> bool:
        return self.rank.is_sending(key)

    async def begin_send(self, key: str, /) -> Outgoing:
        return await self.rank.begin_send(key)

    async def begin_send_heads(self, key: str, heads: range, group_pulls: int) -> KVExport:
        return await self.rank.begin_send_heads(key, heads, group_pulls)

    async def end_send(self, key: str, /, ok: bool) -> None:
        await self.rank.end_send(key, ok)
