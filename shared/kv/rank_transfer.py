"""The decode side's pull plan, for a group of R ranks (R = 1: a single decode worker).

Every decode rank j of a tp = R group pulls the KV heads it owns from the prefill rank(s) holding them
(`pull_rank_kv`: reslice.plan_pulls, one pull per source rank, all at once, assembled into a tensor of exactly
its pool's heads). A decode worker of one rank pulling from a prefill worker of one rank (its location has no
group record) takes the whole KV in one pull instead (decode_kv.py: posted receives, a borrowed pool or the segment
on one host, a layer stream). A group of several: the
leader asks every rank at once (`pull_group_kv`, agent call `kv.pull`); each keeps what it pulled in its
`StagedKv` until the leader's import copies it into blocks (or drops it). The bytes go prefill rank → decode rank;
no leader relays them.

Ids: a rank of decode group G is the transfer worker `G#r<rank>` (endpoints.rank_worker_id); its pull tickets
name G, so one ticket minted by the group covers every rank, and a ticket of another group is refused at every
prefill rank (the servers check pull tickets against `group_of(caller)`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.registry import GroupKv
from shared.kv.reslice import IncompatibleKv, check_compatible, group_pulls, plan_pulls
from shared.kv.transfer import FailureReason, KvTransferClient, KvTransferError
from shared.ranklink.agents import StagedKv
from shared.sharding.layout import LayoutError, kv_head_range

log = logging.getLogger(__name__)


class Agent(Protocol):
    """What these functions need of a rank agent (the `groups` runtime): async handlers by name."""

    def register(self, name: str, handler: Callable[[Any], Awaitable[Any]], replace: bool = False) -> None: ...


async def pull_rank_kv(
    client: KvTransferClient, record: GroupKv, request_id: str, layout: KVLayout, dst_tp: int, dst_rank: int
) -> KVExport:
    """The KV heads decode rank `dst_rank` of a tp = `dst_tp` group owns, pulled from the prefill ranks
    holding them (`layout`: the model's, all heads; the result holds the rank's slice, in pool order, at the
    source's block size). Raises KvTransferError: INCOMPATIBLE for another model's KV, else as `pull`."""
    try:
        check_compatible(record, layout, dst_tp)
        plan = plan_pulls(layout.num_kv_heads, record.tp, dst_tp, dst_rank)
    except (IncompatibleKv, LayoutError) as e:
        raise KvTransferError(FailureReason.INCOMPATIBLE, str(e)) from e
    total = group_pulls(layout.num_kv_heads, record.tp, dst_tp)
    parts = await asyncio.gather(
        *(client.pull(record.ranks[p.rank].rpc_address, request_id, _with_heads(layout, p.heads), total) for p in plan)
    )
    first = parts[0]
    if any(
        p.num_tokens != first.num_tokens
        or p.first_block != first.first_block
        or p.blocks.shape[:4] != first.blocks.shape[:4]
        for p in parts
    ):
        raise KvTransferError(FailureReason.PROTOCOL, f"the prefill ranks sent {request_id!r}'s KV in different shapes")
    heads = kv_head_range(layout.num_kv_heads, dst_tp, dst_rank)
    out = first.blocks.new_empty((*first.blocks.shape[:4], len(heads), layout.head_dim))
    for pull, part in zip(plan, parts, strict=True):
        out[:, :, :, :, pull.dst.start : pull.dst.stop] = part.blocks
        client.recycle(part)
    mine = dataclasses.replace(layout, block_size=first.layout.block_size, kv_heads=tuple(heads))
    return KVExport(mine, first.num_tokens, out, first_block=first.first_block)


def _with_heads(layout: KVLayout, heads: range) -> KVLayout:
    return dataclasses.replace(layout, kv_heads=tuple(heads))


class PullJob(msgspec.Struct, frozen=True):
    """What the decode leader sends each rank's `kv.pull` handler."""

    request_id: str
    record: GroupKv
    dst_tp: int


def register_pull(agent: Agent, client: KvTransferClient, staged: StagedKv, layout: KVLayout, rank: int) -> None:
    """Register `kv.pull` (a PullJob → None, or the failure's reason) and `kv.drop` ({key}) on a decode
    rank's agent: the pulled heads wait in `staged` (under the request id) for the leader's import op."""

    async def pull(job: PullJob) -> str | None:
        try:
            kv = await pull_rank_kv(client, job.record, job.request_id, layout, job.dst_tp, rank)
        except KvTransferError as e:
            return f"{e.reason.value}: {e}"
        staged.stage(job.request_id, kv)
        return None

    async def drop(payload: dict[str, str]) -> None:
        staged.drop(payload["key"])

    agent.register("kv.pull", pull, replace=True)  # again after kv.stop: a worker that switched role and back
    agent.register("kv.drop", drop, replace=True)


class Agents(Protocol):
    """The decode leader's handle on its group's rank agents (the `groups` runtime)."""

    async def call_all(self, name: str, payloads_by_rank: dict[int, Any]) -> dict[int, Any]: ...


async def pull_group_kv(agents: Agents, dst_tp: int, request_id: str, record: GroupKv) -> str | None:
    """The decode leader's step: every rank pulls its heads into its StagedKv at once. None: all staged, the
    import op may copy them into the blocks; else the first failure's reason, and every rank has dropped its
    staged data (the leader recomputes or fails per `kv_fallback`). A rank whose call itself fails (it is
    gone) counts as a failure too."""
    job = PullJob(request_id, record, dst_tp)
    try:
        results = await agents.call_all("kv.pull", {rank: job for rank in range(dst_tp)})
        failures = [f"rank {rank}: {reason}" for rank, reason in sorted(results.items()) if reason is not None]
    except Exception as e:  # AgentError: a rank is gone (its group goes down with it) or its handler raised
        failures = [str(e)]
    if not failures:
        return None
    await drop_group_kv(agents, dst_tp, request_id)
    return failures[0]


async def drop_group_kv(agents: Agents, dst_tp: int, request_id: str) -> None:
    """Every rank forgets what it staged for `request_id` (a pull that failed somewhere, an import that did not
    happen). Best effort: a rank that is gone takes its group down anyway."""
    try:
        await agents.call_all("kv.drop", {rank: {"key": request_id} for rank in range(dst_tp)})
    except Exception as e:
        log.warning("dropping the staged KV of %s failed on some rank: %s", request_id, e)
