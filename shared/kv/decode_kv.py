"""The decode worker's KV pulls, for its R ranks (R = 1: a single worker): the decode half of the one hand-off.

`DecodeKv.pull(key, location)` is the one call: it plans the pull from the location's record (a single prefill
worker is a group of one rank: `reslice.group_record`) and runs it for every rank of this worker.

- R = 1: the rank is in-process: its own transfer client pulls (rank_transfer.pull_rank_kv): the whole KV in one
  pull from a prefill worker of one rank (posted receives, a borrowed pool or the segment on one host, a layer
  stream), or its heads rank by rank from a prefill group. → the KV, to import.
- R > 1: every rank pulls its own heads at once through its agent (`kv.pull`) and stages them; → a
  `StagedExport` (the leader's reference), which the import writes on every rank, or `drop` forgets.

Either way a failure comes back as its reason (`Pulled.failure`), never raised: the caller recomputes or fails
per kv_fallback. The clients are built from the worker's one `KvTransferSettings` (endpoints.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.endpoints import kv_client
from shared.kv.rank_agents import RankPuller, encode
from shared.kv.rank_transfer import drop_group_kv, pull_group_kv, pull_rank_kv
from shared.kv.ranks import KvRanks
from shared.kv.registry import GroupKv, KvLocation
from shared.kv.reslice import IncompatibleKv, check_compatible, group_record
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.ranklink.agents import StagedExport
from shared.settings import KvTransferSettings
from shared.sharding.layout import LayoutError

log = logging.getLogger(__name__)


class Pulled(NamedTuple):
    """A pull's outcome: the KV (a StagedExport for a group of several), or None and why it could not be had."""

    kv: KVExport | None
    failure: str | None


class DecodeKv:
    """Pulls held KV into this decode worker's ranks (see the module). Methods run on the worker's loop."""

    def __init__(
        self,
        kv: KvTransferSettings,
        worker_id: str,
        layout: KVLayout,
        *,
        secret: str,
        model_name: str,
        ranks: KvRanks | None = None,
    ) -> None:
        """layout: the engine's (the leader's pool; its model's heads are what a plan works in)."""
        self.kv, self.worker_id, self.layout = kv, worker_id, layout
        self.secret, self.model_name, self.ranks = secret, model_name, ranks
        self.client: KvTransferClient | None = None  # rank 0's of a worker of one, set by start

    async def start(self) -> None:
        """Build every rank's client (a group's: each in its own process, `kv.puller`)."""
        if self.ranks is None:
            self.client = kv_client(self.kv, self.worker_id, secret=self.secret, model_name=self.model_name)
            return
        job = encode(RankPuller(self.worker_id, self.kv, self.secret, self.model_name))
        await self.ranks.agents.call_all("kv.puller", dict.fromkeys(range(self.ranks.tp), job))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.ranks is not None:
            await self.ranks.agents.call_all("kv.stop", dict.fromkeys(range(self.ranks.tp)))

    async def pull(self, key: str, loc: KvLocation, *, streamed: bool = False, skip_tokens: int = 0) -> Pulled:
        """The KV held under `key` at `loc`, pulled into every rank. streamed: the job's KV is layer-streamed (its
        trailer carries the first token: the receives are not posted ahead). skip_tokens: a partial pull (this
        worker's cache holds the prompt's first tokens, docs/kv_transfer.md): asked of a single prefill worker by a
        worker of one rank; a group pulls whole (the result's first_block says what came)."""
        model = dataclasses.replace(self.layout, kv_heads=())
        record = loc.group or group_record(model, 1, [loc.rpc_address])
        if self.ranks is None:
            return await self._pull_here(key, loc, record, streamed, skip_tokens)
        try:
            check_compatible(record, model, self.ranks.tp)
        except (IncompatibleKv, LayoutError) as exc:
            log.warning("the KV of %s cannot be pulled from %s: %s", key, loc.worker_id, exc)
            return Pulled(None, f"incompatible KV at {loc.worker_id}: {exc}")
        failure = await pull_group_kv(self.ranks.agents, self.ranks.tp, key, record)
        if failure is not None:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, failure)
            return Pulled(None, f"pulling it from {loc.worker_id} failed: {failure}")
        return Pulled(self.ranks.staged.ref(key), None)

    async def _pull_here(self, key: str, loc: KvLocation, record: GroupKv, streamed: bool, skip: int) -> Pulled:
        """A worker of one rank: its own client pulls, the whole KV from a prefill worker of one rank (the
        location's token count lets the receives be posted before the Pull, posted.py; a streamed KV is not sent
        into them: its trailer follows the layers), or its heads rank by rank from a prefill group."""
        assert self.client is not None, "DecodeKv.start first"
        try:
            if loc.group is None:
                expected = None if streamed else loc.num_tokens
                kv = await self.client.pull(loc.rpc_address, key, self.layout, num_tokens=expected, skip_tokens=skip)
            else:
                kv = await pull_rank_kv(self.client, record, key, self.layout, 1, 0)
            return Pulled(kv, None)
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, exc)
            return Pulled(None, f"pulling it from {loc.worker_id} failed: {exc}")

    def recycle(self, kv: KVExport) -> None:
        """Hand a pulled KV back once imported (its buffer serves the next pull; a borrowed one is released). A
        group's staged KV was taken by the import: nothing to give back."""
        if self.client is not None and not isinstance(kv, StagedExport):
            self.client.recycle(kv)

    async def drop(self, kv: KVExport) -> None:
        """A pulled KV that will not be imported: a group's ranks forget what they staged."""
        if self.ranks is not None and isinstance(kv, StagedExport):
            await drop_group_kv(self.ranks.agents, self.ranks.tp, kv.key)
