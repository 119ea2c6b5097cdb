"""Every request's KV a prefill worker holds for a pull: one record per attempt key, HELD → SENDING → FREED.

`HeldKv` is the only owner of that hand-off. Per key it keeps the state, the lease timer and the Redis
location entry, and it releases the engine's blocks exactly once. The prefill worker calls `hold`,
`cancel`, `release` and `release_all`; the transfer server calls `begin_send` / `end_send` (as its
`KvSource`). The lease timer and the Redis entry's TTL are both `lease_s`, both started by `hold`.

States (blocks owner; lease timer; Redis entry → exits):
- HELD: this worker, blocks pinned in the engine; timer running; entry written (TTL = lease).
  → SENDING on an accepted pull (begin_send); → FREED on lease expiry, cancel, release, release_all.
- SENDING: the send (a copy of the blocks is on the wire; the blocks stay pinned); timer running, but its
  expiry, a cancel or a release only mark the record: the blocks are freed when the send ends; entry kept.
  → FREED on end_send (sent or failed) or release_all; → HELD if the export raised (nothing was sent),
  straight on to FREED if the record was marked meanwhile.
- FREED: the engine (its blocks released exactly once); timer cancelled; entry deleted (its TTL if the delete
  fails). No record is left: `state` answers FREED for any key it does not hold.

A failed send frees the blocks (as a pulled one does): the puller's copy is unusable and its pair dropped,
so decode recomputes; only a send that never started (the export raised) goes back to HELD.

Head slices (a decode worker group pulling from this single worker: each decode rank takes its own KV heads,
shared/kv/reslice.py): `begin_send_heads` lets several slice sends of one key run side by side (SENDING while
any is in flight; the KV is exported once and each slice copied from that export). The Pull says how many
transfers the decode group makes; the blocks are freed once that many ended well, or when the sends in flight
end after a failed one (or a lease expiry, a cancel); between slices the record is HELD again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.registry import KvLocation
from shared.kv.transfer.source import AlreadySending, KvBlocks, Outgoing

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
    NOT_RECORDED = "not_recorded"  # the Redis entry could not be written: nobody could find the KV
    SHUTDOWN = "shutdown"


class Locations(Protocol):
    """Where held KV is announced (KvRegistry: Redis, entries expiring with the lease)."""

    async def put(self, loc: KvLocation) -> None: ...

    async def delete(self, request_id: str) -> None: ...


@dataclass
class _Record:
    key: str
    request_id: str
    attempt: int
    timer: asyncio.TimerHandle | None  # None once the lease has run out (or the record is freed)
    state: HeldState = HeldState.HELD
    free_after_send: Freed | None = None  # set while SENDING by lease expiry, cancel or release
    # head-slice sends (a decode group's ranks pulling their heads): in flight, ended well, expected in all
    slices_in_flight: int = 0
    slices_ok: int = 0
    group_pulls: int = 0
    export: asyncio.Task[KVExport] | None = None  # the one export every slice is copied from


class HeldKv:
    """The prefill worker's held KV (see the module's table). Methods run on the event loop."""

    def __init__(self, blocks: KvBlocks, lease_s: float, registry: Locations | None = None) -> None:
        """blocks: the engine side (export, free). lease_s: how long KV waits for a pull. registry: where
        `hold` writes each location and the free deletes it; None = nobody looks KV up (tests, benchmarks)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.blocks = blocks
        self.lease_s = lease_s
        self.registry = registry
        self.freed: Counter[Freed] = Counter()  # records freed so far, by why
        self._records: dict[str, _Record] = {}  # HELD or SENDING, by attempt key
        self._freeing: set[asyncio.Task[None]] = set()  # frees started from a callback

    @property
    def layout(self) -> KVLayout:
        return self.blocks.layout

    def state(self, key: str) -> HeldState:
        record = self._records.get(key)
        return HeldState.FREED if record is None else record.state

    def count(self) -> int:
        """Requests held or being sent (the heartbeat's `held_kv`)."""
        return len(self._records)

    def keys(self) -> list[str]:
        return list(self._records)

    def is_sending(self, key: str) -> bool:
        """A whole-KV send is in flight (slice sends of a decode group's ranks may run side by side)."""
        record = self._records.get(key)
        return record is not None and record.state is HeldState.SENDING and not record.slices_in_flight

    # ---- the prefill worker's side -------------------------------------------------------------------------

    async def hold(self, key: str, request_id: str, attempt: int, location: KvLocation | None = None) -> bool:
        """Take over a finished request's pinned blocks: HELD, lease timer armed, `location` written to the
        registry. False when that write fails (logged; the blocks are freed at once: no decode worker could
        find them, it recomputes) or a cancel freed the key meanwhile. Raises ValueError for a key held already."""
        if key in self._records:
            raise ValueError(f"KV of {key!r} is held already")
        if self.registry is not None and location is None:
            raise ValueError("a HeldKv with a registry needs the location to write")
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._lease_expired, key)
        record = self._records[key] = _Record(key, request_id, attempt, timer)
        if self.registry is None or location is None:
            return True
        try:
            await self.registry.put(location)
        except Exception as exc:  # Redis unreachable
            log.warning("could not record the KV location of %s (%s); decode will recompute", key, exc)
            await self._free(key, Freed.NOT_RECORDED)
            return False
        if self._records.get(key) is not record:  # cancelled during the write: its delete may have come first
            await self._delete_entry(key)
            return False
        return True

    async def release(self, key: str, why: Freed = Freed.CANCELLED) -> None:
        """Free a HELD key now; a SENDING one when its send ends. No-op for a key not held."""
        record = self._records.get(key)
        if record is None:
            return
        if record.state is HeldState.SENDING:
            record.free_after_send = record.free_after_send or why
            stop = getattr(self.blocks, "stop_stream", None)  # a layer-streamed send stops now, not at its end
            if stop is not None:
                stop(key, f"its KV was released ({why.value})")
            return
        await self._free(key, why)

    async def cancel(self, request_id: str, covers: Callable[[int], bool]) -> int:
        """`release` every key of `request_id` whose attempt `covers` accepts; how many it found."""
        found = [r.key for r in self._records.values() if r.request_id == request_id and covers(r.attempt)]
        for key in found:
            await self.release(key, Freed.CANCELLED)
        return len(found)

    async def release_all(self) -> None:
        """Free every record now, SENDING ones too (teardown, after the transfer server stopped: its stop
        waits for the sends in flight, so none is left mid-send), and wait for frees already started."""
        for key in list(self._records):
            await self._free(key, Freed.SHUTDOWN)
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)

    # ---- the transfer server's side (KvSource) -------------------------------------------------------------

    async def begin_send(self, key: str) -> Outgoing:
        """HELD → SENDING and the KV to send (a copy, or the blocks themselves). KeyError: not held;
        AlreadySending: in flight. If the export raises, nothing was sent: back to HELD (or freed, if the
        lease ran out or a cancel came)."""
        record = self._records.get(key)
        if record is None:
            raise KeyError(f"no KV held for request {key!r}")
        if record.state is HeldState.SENDING:
            raise AlreadySending(f"request {key!r} is already being pulled")
        record.state = HeldState.SENDING
        try:
            return await self.blocks.export_kv(key)
        except BaseException:
            if self._records.get(key) is record:  # not freed by release_all meanwhile
                record.state = HeldState.HELD
                if record.free_after_send is not None:
                    self._free_soon(key, record.free_after_send)
            raise

    async def begin_send_heads(self, key: str, heads: range, group_pulls: int) -> KVExport:
        """A copy of KV heads `heads` (global ids) of the key's KV, for one of a decode group's `group_pulls`
        transfers. KeyError: not held (or being freed); AlreadySending: a whole-KV send is in flight;
        ValueError: heads outside the model's."""
        record = self._records.get(key)
        if record is None or record.free_after_send is not None:
            raise KeyError(f"no KV held for request {key!r}")
        if record.state is HeldState.SENDING and not record.slices_in_flight:
            raise AlreadySending(f"request {key!r} is already being pulled whole")
        if not heads or heads.start < 0 or heads.stop > self.layout.num_kv_heads or group_pulls < 1:
            raise ValueError(f"KV heads {list(heads)} of {self.layout.num_kv_heads} (group of {group_pulls} pulls)")
        record.state = HeldState.SENDING
        record.slices_in_flight += 1
        record.group_pulls = group_pulls
        if record.export is None:  # the first slice exports; the others wait for the same export
            record.export = asyncio.ensure_future(self._export_whole(key))
        try:
            full = await asyncio.shield(record.export)
        except BaseException:
            record.export = None
            await self._slice_ended(key, record, ok=None)
            raise
        if full.parts:  # kv_groups.py: a hybrid model's flat export of several groups
            await self._slice_ended(key, record, ok=None)
            raise ValueError(
                f"the KV of {key!r} lies in {len(full.parts)} KV cache groups (full and sliding layers): a decode "
                "worker group's head slices of it are not supported yet; pull it whole into a single-rank engine"
            )
        layout = dataclasses.replace(full.layout, kv_heads=tuple(heads))  # its planes too (a latent stays one)
        blocks = full.blocks[:, :, :, :, heads.start : heads.stop].contiguous()
        return KVExport(layout, full.num_tokens, blocks, first_block=full.first_block)

    async def _export_whole(self, key: str) -> KVExport:
        return _as_export(await self.blocks.export_kv(key))

    async def end_send(self, key: str, ok: bool) -> None:
        """The send is over: free the blocks whatever its outcome (a no-op if release_all got there first). A
        slice send frees them once the group's pulls all ended well, or (failed) once none is in flight."""
        record = self._records.get(key)
        if record is not None and record.slices_in_flight:
            await self._slice_ended(key, record, ok)
        elif self.is_sending(key):
            await self._free(key, Freed.PULLED if ok else Freed.SEND_FAILED)

    async def _slice_ended(self, key: str, record: _Record, ok: bool | None) -> None:
        """One slice send ended (ok None: it never started: the export raised)."""
        record.slices_in_flight -= 1
        if ok:
            record.slices_ok += 1
        elif ok is False:
            record.free_after_send = record.free_after_send or Freed.SEND_FAILED
        if record.slices_in_flight or self._records.get(key) is not record:
            return
        if record.free_after_send is not None:
            await self._free(key, record.free_after_send)
        elif record.slices_ok >= record.group_pulls:
            await self._free(key, Freed.PULLED)
        else:
            record.state = HeldState.HELD  # more of the group's pulls to come

    # ---- freeing ---------------------------------------------------------------------------------------------

    def _lease_expired(self, key: str) -> None:
        record = self._records.get(key)
        if record is None:
            return
        record.timer = None
        if record.state is HeldState.SENDING:  # the send owns the blocks: they are freed when it ends
            log.info("KV lease of %s expired during its send; freeing it when the send ends", key)
            record.free_after_send = record.free_after_send or Freed.LEASE_EXPIRED
            return
        log.warning("KV lease of %s expired before any pull; freeing its blocks", key)
        self._free_soon(key, Freed.LEASE_EXPIRED)

    def _take(self, key: str, why: Freed) -> bool:
        """Forget the record (so nothing else frees it) and stop its timer; False if there was none."""
        record = self._records.pop(key, None)
        if record is None:
            return False
        if record.timer is not None:
            record.timer.cancel()
        self.freed[why] += 1
        return True

    async def _free(self, key: str, why: Freed) -> None:
        if self._take(key, why):
            await self._release(key, why)

    def _free_soon(self, key: str, why: Freed) -> None:
        """`_free` from a callback: the record goes now, the engine and Redis calls run in a task."""
        if self._take(key, why):
            task = asyncio.create_task(self._release(key, why))
            self._freeing.add(task)
            task.add_done_callback(self._freeing.discard)

    async def _release(self, key: str, why: Freed) -> None:
        """The engine's blocks, then the Redis entry; failures are logged (the entry's TTL removes it)."""
        log.debug("freeing the KV of %s (%s)", key, why.value)
        try:
            await self.blocks.release_kv(key)
        except Exception:
            log.exception("releasing the KV of %s failed", key)
        await self._delete_entry(key)

    async def _delete_entry(self, key: str) -> None:
        if self.registry is None:
            return
        try:
            await self.registry.delete(key)
        except Exception as exc:  # the entry's TTL removes it anyway
            log.warning("could not delete the KV location of %s: %s", key, exc)


def _as_export(kv: Outgoing) -> KVExport:
    """The KV as one tensor, which head slices are cut from: a send planned straight from the pool's blocks
    is gathered once (every slice of the group's pulls shares that copy)."""
    if isinstance(kv, KVExport):
        return kv
    out = torch.empty(kv.shape, dtype=kv.layout.torch_dtype)
    kv.copy_into(out)
    return KVExport(kv.layout, kv.num_tokens, out, first_block=kv.first_block)
