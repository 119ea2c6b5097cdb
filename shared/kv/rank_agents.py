"""The KV hand-off's handlers on every rank of a worker group of several, set up from the leader through its agents.

A group's services do not build a rank's transfer server or client themselves: the leader asks every rank
(itself included, through its local agent) to, with one agent call each, so the rank's own process binds its
own gRPC port and forms its own pairs, and KV moves rank to rank. Each call carries the worker's one
`KvTransferSettings`, msgspec-encoded (`RankServe` / `RankPuller`); the rank builds its server or client from
it exactly as a single worker does (endpoints.py).

- `kv.serve` (a prefill rank): a `RankKv` over this rank's pool slice and its server; `kv.hold` / `kv.close` /
  `kv.retire` are the leader's rank link to it (`AgentRankLink`), and its sends are reported to the leader as the
  events `kv.send_began` (key) and `kv.send_ended` (key, outcome, group pulls). → the address to publish.
- `kv.puller` (a decode rank): this rank's client, transfer id `<group>#r<rank>`, pull tickets naming the group;
  `kv.pull` / `kv.drop` pull its heads into its StagedKv, or forget them (rank_transfer.py).
- `kv.stop`: stop this rank's server and client (the leader's teardown; a follower's exit stops them anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from shared.engine.kv_pool import KVPool
from shared.kv.endpoints import kv_client, kv_server, rank_worker_id
from shared.kv.rank_held import HeldTable, RankKv, SendOutcome
from shared.kv.rank_transfer import register_pull
from shared.kv.transfer import KvTransferClient, KvTransferServer
from shared.kv.transfer.send_stream import SendStream
from shared.ranklink.agents import GroupAgents, RankAgent, StagedKv
from shared.settings import KvTransferSettings

SEND_BEGAN = "kv.send_began"  # a prefill rank's event: a send of (key) started
SEND_ENDED = "kv.send_ended"  # a prefill rank's event: a send ended, (key, outcome value, group pulls)


class RankServe(msgspec.Struct, frozen=True):
    """What a prefill rank needs to serve its slice (msgspec-encoded over the group's channel)."""

    kv: KvTransferSettings
    secret: str
    model_name: str
    leader_port: int  # the configured port, for rank 0 only; the others bind any free port


class RankPuller(msgspec.Struct, frozen=True):
    """What a decode rank needs to pull its heads: its group's id (the worker id) and the transfer settings."""

    group_id: str
    kv: KvTransferSettings
    secret: str
    model_name: str


class AgentReports:
    """SendReports of a rank of a group: the leader's events (its own rank's are dispatched in-process)."""

    def __init__(self, agent: RankAgent) -> None:
        self.agent = agent

    async def send_began(self, key: str, rank: int) -> None:
        await self.agent.notify(SEND_BEGAN, key)

    async def send_ended(self, key: str, rank: int, outcome: SendOutcome, group_pulls: int) -> None:
        await self.agent.notify(SEND_ENDED, (key, outcome.value, group_pulls))


class AgentRankLink:
    """The leader's HeldKv's handle on one rank's RankKv, through the group's agents."""

    def __init__(self, agents: GroupAgents, rank: int) -> None:
        self.agents, self.rank = agents, rank

    async def hold(self, key: str, table: HeldTable | None = None) -> None:
        await self.agents.call(self.rank, "kv.hold", (key, msgspec.msgpack.encode(table)))

    async def close(self, key: str, stop_why: str | None = None) -> None:
        await self.agents.call(self.rank, "kv.close", (key, stop_why))

    async def retire(self, key: str, wait: bool = True) -> None:
        await self.agents.call(self.rank, "kv.retire", (key, wait))


def on_rank_reports(agents: GroupAgents, leader) -> None:
    """Route the ranks' send events to `leader` (the group's HeldKv), on the calling loop; a later call (the worker
    switched role and back: a new HeldKv) routes them to the new one."""

    async def began(rank: int, key: str) -> None:
        await leader.send_began(key, rank)

    async def ended(rank: int, payload: tuple[str, str, int]) -> None:
        key, outcome, group_pulls = payload
        await leader.send_ended(key, rank, SendOutcome(outcome), group_pulls)

    agents.on_event(SEND_BEGAN, began, replace=True)
    agents.on_event(SEND_ENDED, ended, replace=True)


def register_rank_link(agent: RankAgent, held: RankKv) -> None:
    """Register kv.hold / kv.close / kv.retire: the leader's rank link (AgentRankLink) to this rank's RankKv."""

    async def hold(payload: tuple[str, bytes]) -> None:
        key, table = payload
        await held.hold(key, msgspec.msgpack.decode(table, type=HeldTable | None))

    async def close(payload: tuple[str, str | None]) -> None:
        await held.close(*payload)

    async def retire(payload: tuple[str, bool]) -> None:
        await held.retire(*payload)

    agent.register("kv.hold", hold)
    agent.register("kv.close", close)
    agent.register("kv.retire", retire)


def register_rank_kv(agent: RankAgent, pool: KVPool, staged: StagedKv) -> None:
    """Register the hand-off's handlers on this rank's agent (every rank of a group, at start)."""
    servers: list[KvTransferServer] = []
    clients: list[KvTransferClient] = []
    stream = SendStream(pool.tensor.device)  # the slices' copies and the sends, off the compute stream (CUDA)
    held = RankKv(agent.rank, AgentReports(agent), pool=pool, send_stream=stream)
    register_rank_link(agent, held)

    async def serve(encoded: bytes) -> str:
        job = msgspec.msgpack.decode(encoded, type=RankServe)
        port = job.leader_port if agent.rank == 0 else 0
        server = kv_server(job.kv, held, secret=job.secret, model_name=job.model_name, port=port,
                           send_stream=stream, shared_pool=pool.handle())  # fmt: skip
        address = await server.start()
        servers.append(server)
        return address

    async def puller(encoded: bytes) -> None:
        job = msgspec.msgpack.decode(encoded, type=RankPuller)
        worker = rank_worker_id(job.group_id, agent.rank)
        client = kv_client(job.kv, worker, secret=job.secret, model_name=job.model_name, group_id=job.group_id)
        clients.append(client)
        # the plan works in the model's heads (all of them); the pulled part is this pool's slice
        register_pull(agent, client, staged, dataclasses.replace(pool.layout, kv_heads=()), agent.rank)

    async def stop(_: Any) -> None:
        for server in servers:
            await server.stop()  # waits for the sends in flight
        for client in clients:
            await client.close()
        servers.clear()
        clients.clear()

    agent.register("kv.serve", serve)
    agent.register("kv.puller", puller)
    agent.register("kv.stop", stop)


def encode(job: RankServe | RankPuller) -> bytes:
    return msgspec.msgpack.encode(job)
