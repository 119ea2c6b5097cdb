"""Rank-to-rank KV hand-off between worker groups: the glue each rank process calls.

Prefill side: every rank runs `serve_rank_kv` on its own loop: a `KvTransferServer` over that rank's pool
slice (`RankHeldKv`), and the agent handlers `kv.hold` / `kv.retire` through which the leader's
`GroupHeldKv` tells it what is held and when it is freed. Decode side: every rank's `kv.pull` handler
(`register_pull`) runs `pull_rank_kv`: the pull plan for its heads, one pull per source rank, all at once,
assembled into a tensor of exactly its pool's heads, kept in its `StagedKv` until the leader's import copies
it into blocks (or drops it). The bytes go prefill rank → decode rank; no leader relays them.

Ids: a rank of decode group G is the transfer worker `G#r<rank>` (its pairs, its connect tickets); its pull
tickets name G, so one ticket minted by the group covers every rank, and a ticket of another group is
refused at every prefill rank (the servers check pull tickets against `group_of(caller)`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.group_held import RankHeldKv, SendReport
from shared.kv.registry import GroupKv
from shared.kv.reslice import IncompatibleKv, check_compatible, group_pulls, plan_pulls
from shared.kv.transfer import FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.parallel.agents import StagedKv
from shared.sharding.layout import LayoutError, kv_head_range

log = logging.getLogger(__name__)

RANK_SEPARATOR = "#r"


def rank_worker_id(group_id: str, rank: int) -> str:
    return f"{group_id}{RANK_SEPARATOR}{rank}"


def group_of(worker_id: str) -> str:
    """The group a rank's transfer id belongs to; a single worker's id is its own group."""
    group, sep, rank = worker_id.rpartition(RANK_SEPARATOR)
    return group if sep and group and rank.isdigit() else worker_id


class Agent(Protocol):
    """What these functions need of a rank agent (the `groups` runtime): async handlers by name."""

    def register(self, name: str, handler: Callable[[Any], Awaitable[Any]]) -> None: ...


async def serve_rank_kv(
    agent: Agent | None,
    pool: KVPool,
    rank: int,
    report: SendReport,
    *,
    host: str,
    secret: bytes | str,
    port: int = 0,
    **server: Any,
) -> tuple[RankHeldKv, KvTransferServer, str]:
    """Serve pulls of this rank's pool: (its held KV, its server, the address to publish in the group
    record). `report` carries each ended send to the leader's `GroupHeldKv.send_ended`. With an agent, the
    handlers `kv.hold` ({key, block_ids, num_tokens}) and `kv.retire` ({key}) are registered on it."""
    held = RankHeldKv(pool, rank, report)
    kv_server = KvTransferServer(host, port, held, secret=secret, ticket_holder=group_of, **server)
    address = await kv_server.start()
    if agent is not None:
        agent.register("kv.hold", lambda p: held.hold(p["key"], p["block_ids"], p["num_tokens"]))
        agent.register("kv.retire", lambda p: held.retire(p["key"]))
    return held, kv_server, address


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

    agent.register("kv.pull", pull)
    agent.register("kv.drop", drop)


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
