"""Keeping the prefix index (kv_index.py) in step with every worker's numbered block updates.

A worker incarnation (`epoch`) numbers its updates 1, 2, ... (shared.messages.KvBlockEvents); a snapshot says
what it held after update `seq` (KvBlockSnapshot, maybe in parts). Per worker this gateway is either in step
(it applied every update up to `seq`) or not (it started late, lost an update, or the worker's event log
overflowed): then it wants a snapshot, keeps the updates that arrive meanwhile, and applies those past the
snapshot once it is whole. Until then the index keeps what it had for the worker: a routing hint, never a
correctness matter (a worker without the prefix just computes it).

Heartbeats carry the worker's last update number, so an update lost at the end of a burst (no later update to
reveal the gap) is noticed too: a beat promises updates up to its number, and one beat later they must have come.

Pure state: the caller passes the clock; `wanted(now)` says whose snapshot to ask for (at most every
SNAPSHOT_RETRY_S per worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.kv_index import PrefixIndex
from shared.messages import KvBlockEvents, KvBlockSnapshot, KvBlockUpdate

SNAPSHOT_RETRY_S = 2.0  # ask one worker for its snapshot again at most this often
MAX_EARLY = 256  # updates kept while waiting for a snapshot; past it the oldest go (the snapshot covers them)


@dataclass
class _Worker:
    """One worker incarnation's updates as this gateway applied them."""

    epoch: str
    seq: int | None = None  # the last update applied; None: not in step (waiting for a snapshot)
    early: dict[int, KvBlockEvents] = field(default_factory=dict)  # updates past `seq`, waiting for the gap
    parts: dict[int, list[int]] = field(default_factory=dict)  # the snapshot being assembled, part → hashes
    parts_seq: int = -1  # the update that snapshot follows
    promised: int = 0  # the last update number a heartbeat announced
    asked_at: float | None = None  # when a snapshot was last asked for


class IndexSync:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._workers: dict[str, _Worker] = {}

    def in_step(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.seq is not None

    def on_update(self, update: KvBlockUpdate) -> None:
        w = self._incarnation(update.worker_id, update.epoch)
        if isinstance(update, KvBlockSnapshot):
            self._on_snapshot_part(update.worker_id, w, update)
            return
        if w.seq is None and update.seq == 1:
            w.seq = 0  # the incarnation's first update: this gateway has seen it from the start
        if w.seq is not None and update.seq <= w.seq:
            return  # applied already (a snapshot covered it)
        w.early[update.seq] = update
        if len(w.early) > MAX_EARLY:
            del w.early[min(w.early)]
        self._catch_up(update.worker_id, w)

    def on_heartbeat(self, worker_id: str, epoch: str, seq: int) -> None:
        """A live worker's beat (`epoch` "" = it announces no blocks): a new incarnation, or updates the last
        beat promised that never came, put it out of step."""
        if not epoch:
            return
        w = self._incarnation(worker_id, epoch)
        if w.seq is None and seq == 0 and not w.early and not w.parts:
            w.seq = 0  # it has announced nothing yet: it holds nothing
        if w.seq is not None and w.seq < w.promised:
            self._out_of_step(w)
        w.promised = max(w.promised, seq)

    def drop(self, worker_id: str) -> None:
        """The worker died or drains: out of the index at once. Heard from again, it starts afresh."""
        self._workers.pop(worker_id, None)
        self.index.drop(worker_id)

    def known(self) -> set[str]:
        return set(self._workers)

    def wanted(self, now: float) -> list[str]:
        """Workers out of step whose snapshot was not asked for within SNAPSHOT_RETRY_S; marks them asked."""
        due = [
            worker_id
            for worker_id, w in self._workers.items()
            if w.seq is None and (w.asked_at is None or now - w.asked_at >= SNAPSHOT_RETRY_S)
        ]
        for worker_id in due:
            self._workers[worker_id].asked_at = now
        return due

    def _incarnation(self, worker_id: str, epoch: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None or w.epoch != epoch:  # a restarted worker: what the old one held is gone
            self.index.drop(worker_id)
            w = self._workers[worker_id] = _Worker(epoch)
        return w

    def _out_of_step(self, w: _Worker) -> None:
        w.seq = None
        w.asked_at = None  # ask at once

    def _catch_up(self, worker_id: str, w: _Worker) -> None:
        """Apply the early updates that follow `seq` without a gap; a gap left means out of step."""
        if w.seq is not None:
            while (nxt := w.early.pop(w.seq + 1, None)) is not None:
                self.index.remove(worker_id, nxt.removed)
                self.index.store(worker_id, nxt.block_size, nxt.stored)
                w.seq = nxt.seq
            w.early = {s: u for s, u in w.early.items() if s > w.seq}
        if w.early and w.seq is not None:
            self._out_of_step(w)  # an update is missing: the index may be wrong from here on

    def _on_snapshot_part(self, worker_id: str, w: _Worker, part: KvBlockSnapshot) -> None:
        if w.seq is not None and part.seq <= w.seq and not w.early:
            return  # in step past it already
        if part.seq > w.parts_seq:  # a newer snapshot supersedes one half assembled
            w.parts, w.parts_seq = {}, part.seq
        elif part.seq < w.parts_seq:
            return
        w.parts[part.part] = part.hashes
        if len(w.parts) < part.parts:
            return
        self.index.replace(worker_id, part.block_size, (h for i in range(part.parts) for h in w.parts.get(i, ())))
        w.seq, w.parts, w.parts_seq = part.seq, {}, -1
        self._catch_up(worker_id, w)
