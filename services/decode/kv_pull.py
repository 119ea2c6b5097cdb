"""Admission stage 2, pull: the one object through which the decode side calls the KV plane to bring a located
request's KV here, whatever the transport (negotiated per pair by the transfer client) and the topology:

- this worker is one process: one pull from a single prefill worker, or its heads rank by rank from a prefill
  group's ranks (assembled here);
- this worker is a group whose ranks hold KV head slices: every rank pulls its own heads at once and stages
  them; the result is the leader's reference to the staged KV (StagedExport), which the import writes on
  every rank.

A failure comes back as its reason (`Pulled.failure`), never raised: the pipeline recomputes or fails per
kv_fallback. What a pull returns is the caller's until imported (`recycle`: a receive buffer serves the next
pull, a loan is given back) or given up (`recycle` and `drop`: a staged KV is dropped on every rank).

This is the seam the group-of-one hand-off (shared/kv/decode_kv.py `DecodeKv`, the same interface) replaces.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.rank_agents import RankPuller
from shared.kv.rank_transfer import drop_group_kv, pull_group_kv, pull_rank_kv
from shared.kv.registry import KvLocation
from shared.kv.reslice import IncompatibleKv, check_compatible, group_record
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.parallel.agents import StagedExport
from shared.parallel.group_engine import WorkerGroup
from shared.parallel.layout import LayoutError
from shared.settings import KvTransferSettings

log = logging.getLogger(__name__)


class Pulled(NamedTuple):
    """A pull's outcome: the KV (a StagedExport for a group of several), or None and why it could not be had."""

    kv: KVExport | None
    failure: str | None


class KvPull:
    """The pulls of one decode worker: its transfer client (a group's: one per rank, in the ranks' processes), its
    engine's KV layout and, when its ranks hold head slices, its worker group. Methods run on the worker's loop."""

    def __init__(
        self,
        kv: KvTransferSettings,
        worker_id: str,
        layout: KVLayout,
        *,
        secret: str,
        model_name: str,
        group: WorkerGroup | None = None,
    ) -> None:
        self.kv, self.worker_id, self.layout = kv, worker_id, layout
        self.secret, self.model_name, self.group = secret, model_name, group
        self.client: KvTransferClient | None = None  # set by start

    async def start(self) -> None:
        """Build the transfer client (and a group's ranks' own, each pulling its own heads)."""
        if self.group is not None:
            puller = RankPuller(self.worker_id, self.kv, self.secret, self.model_name)
            await self.group.agents.call_all("kv.puller", dict.fromkeys(range(self.group.layout.tp), puller))
        self.client = KvTransferClient(
            self.worker_id,
            secret=self.secret,
            backend=self.kv.backend,
            timeout_s=self.kv.timeout_s,
            model_name=self.model_name,
            tls=KvTls.load(*self.kv.tls_files),
            shared_memory=self.kv.shm_bytes > 0,
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.group is not None:
            await self.group.agents.call_all("kv.stop", dict.fromkeys(range(self.group.layout.tp)))

    async def pull(self, key: str, loc: KvLocation, *, streamed: bool = False) -> Pulled:
        """The KV held under `key` at `loc`, pulled into this worker (every rank of a group). streamed: the job's
        KV is layer-streamed (its trailer carries the first token: the receives are not posted ahead)."""
        if self.group is not None:
            return await self._pull_into_group(self.group, key, loc)
        assert self.client is not None, "KvPull.start first"
        try:
            if loc.group is not None:  # a prefill group: its ranks' heads, rank by rank, assembled here
                return Pulled(await pull_rank_kv(self.client, loc.group, key, self.layout, 1, 0), None)
            # The location's token count lets the receives be posted before the Pull (kv/transfer/posted.py); a
            # streamed KV is not sent into them (its trailer follows the layers).
            expected = None if streamed else loc.num_tokens
            return Pulled(await self.client.pull(loc.rpc_address, key, self.layout, num_tokens=expected), None)
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, exc)
            return Pulled(None, f"pulling it from {loc.worker_id} failed: {exc}")

    async def _pull_into_group(self, group: WorkerGroup, key: str, loc: KvLocation) -> Pulled:
        """Every rank of this group pulls its own KV heads from the prefill rank(s) holding them (the leader's
        plan, reslice.plan_pulls), all at once, and stages them. A single prefill worker is a group of one."""
        model = dataclasses.replace(self.layout, kv_heads=())
        record = loc.group or group_record(model, 1, [loc.rpc_address])
        try:
            check_compatible(record, model, group.layout.tp)
        except (IncompatibleKv, LayoutError) as exc:
            log.warning("the KV of %s cannot be pulled from %s: %s", key, loc.worker_id, exc)
            return Pulled(None, f"incompatible KV at {loc.worker_id}: {exc}")
        failure = await pull_group_kv(group.agents, group.layout.tp, key, record)
        if failure is not None:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, failure)
            return Pulled(None, f"pulling it from {loc.worker_id} failed: {failure}")
        return Pulled(group.ops.state.staged.ref(key), None)

    def recycle(self, kv: KVExport) -> None:
        """Hand a pulled KV back once imported or given up (its buffer serves the next pull, no fresh page faults;
        a borrowed one is released, so the prefill worker frees its blocks). A group's staged KV: nothing here."""
        if self.client is not None and not isinstance(kv, StagedExport):
            self.client.recycle(kv)

    async def drop(self, kv: KVExport) -> None:
        """A pulled KV that will not be imported: a group's ranks forget what they staged."""
        if self.group is not None and isinstance(kv, StagedExport):
            await drop_group_kv(self.group.agents, self.group.layout.tp, kv.key)
