"""Admission stage 2, pull: the one call the decode side makes into the KV plane to bring a located request's
KV here, whatever the transport (negotiated per pair by the transfer client) and the topology:

- this worker is one process: one pull from a single prefill worker, or rank by rank from a prefill group's
  ranks (their heads assembled here);
- this worker is a group whose ranks hold KV head slices: every rank pulls its own heads at once and stages
  them; the result is the leader's reference to the staged KV (StagedExport), which the import writes on
  every rank.

What a pull returns is owned by the caller until it is imported (`imported`) or given up (`discard`): a
receive buffer goes back for the next pull, a borrowed KV gives its loan back, a staged one is dropped on
every rank. This module is the seam the group-of-one hand-off replaces: the pipeline knows only KvPull.
"""

from __future__ import annotations

import dataclasses
import logging

from services.decode.locate import Missing, kv_key
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.rank_transfer import drop_group_kv, pull_group_kv, pull_rank_kv
from shared.kv.registry import KvLocation
from shared.kv.reslice import IncompatibleKv, check_compatible, group_record
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.messages import DecodeJob
from shared.parallel.agents import StagedExport
from shared.parallel.group_engine import WorkerGroup
from shared.parallel.layout import LayoutError

log = logging.getLogger(__name__)


class KvPull:
    """Pulls for one decode worker: its transfer client, its engine's KV layout and, when its ranks hold head
    slices, its worker group."""

    def __init__(self, client: KvTransferClient, layout: KVLayout, group: WorkerGroup | None) -> None:
        self.client, self.layout, self.group = client, layout, group

    async def pull(self, job: DecodeJob, loc: KvLocation) -> KVExport | Missing:
        """The job's KV from where `loc` says it is held, or Missing (the transfer failed, or the two layouts
        cannot meet). Raises only on a bug."""
        key = kv_key(job)
        if self.group is not None:
            return await self._pull_into_group(self.group, key, loc)
        try:
            if loc.group is not None:  # a prefill group: its ranks' heads, rank by rank, assembled here
                return await pull_rank_kv(self.client, loc.group, key, self.layout, 1, 0)
            # The location's token count lets the receives be posted before the Pull (kv/transfer/posted.py); a
            # streamed KV is not sent into them (its trailer follows the layers).
            expected = None if job.kv_streamed else loc.num_tokens
            return await self.client.pull(loc.rpc_address, key, self.layout, num_tokens=expected)
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, exc)
            return Missing(f"pulling it from {loc.worker_id} failed: {exc}")

    async def _pull_into_group(self, group: WorkerGroup, key: str, loc: KvLocation) -> KVExport | Missing:
        """Every rank of this group pulls its own KV heads from the prefill rank(s) holding them (the leader's
        plan, reslice.plan_pulls), all at once, and stages them. A single prefill worker is a group of one."""
        model = dataclasses.replace(self.layout, kv_heads=())
        record = loc.group or group_record(model, 1, [loc.rpc_address])
        try:
            check_compatible(record, model, group.layout.tp)
        except (IncompatibleKv, LayoutError) as exc:
            log.warning("the KV of %s cannot be pulled from %s: %s", key, loc.worker_id, exc)
            return Missing(f"incompatible KV at {loc.worker_id}: {exc}")
        failure = await pull_group_kv(group.agents, group.layout.tp, key, record)
        if failure is not None:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, failure)
            return Missing(f"pulling it from {loc.worker_id} failed: {failure}")
        return group.ops.state.staged.ref(key)

    def imported(self, kv: KVExport) -> None:
        """`kv` is in the engine's blocks now: its receive buffer serves the next pull (no fresh page faults), a
        loan is given back. A staged KV was taken by every rank's import: nothing left to do."""
        if not isinstance(kv, StagedExport):
            self.client.recycle(kv)

    async def discard(self, kv: KVExport) -> None:
        """`kv` will not be imported (cancelled, no room, or its first token ended the request): given back, a
        loan to a connection that is over already too, and a staged KV dropped on every rank."""
        if isinstance(kv, StagedExport):
            if self.group is not None:
                await drop_group_kv(self.group.agents, self.group.layout.tp, kv.key)
            return
        self.client.recycle(kv)  # a BorrowedKv: released, so the prefill worker frees its blocks
