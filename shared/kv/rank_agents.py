"""The KV hand-off's handlers on every rank of a worker group, set up from the leader through its agents.

A worker group's services do not build a rank's transfer server or client themselves: the leader asks every
rank (itself included, through its local agent) to, with one agent call each, so the rank's own process binds
its own gRPC port and forms its own pairs, and KV moves rank to rank:

- `kv.serve` (a prefill rank; a `RankServe`): start this rank's `KvTransferServer` over its pool slice
  (rank_transfer.serve_rank_kv: `kv.hold` / `kv.retire` are registered with it); every ended send is reported
  to the leader as the event `kv.send_ended` (key, ok, group pulls). → the address to publish.
- `kv.puller` (a decode rank; a `RankPuller`): build this rank's `KvTransferClient`, transfer id
  `<group>#r<rank>`, pull tickets naming the group; registers `kv.pull` / `kv.drop` (rank_transfer.register_pull).
- `kv.stop`: stop this rank's server and client (the leader's teardown; a follower's exit stops them anyway).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shared.engine.kv_pool import KVPool
from shared.kv.rank_transfer import rank_worker_id, register_pull, serve_rank_kv
from shared.kv.transfer import KvTransferClient, KvTransferServer
from shared.kv.transfer.channel_tls import KvTls
from shared.parallel.agents import RankAgent, StagedKv
from shared.settings import KvTransferSettings

SEND_ENDED = "kv.send_ended"  # the event a prefill rank reports each ended send with: (key, ok, group pulls)


@dataclass(frozen=True)
class RankServe:
    """What a prefill rank needs to serve its slice (pickled to the follower over the group's channel)."""

    kv: KvTransferSettings
    secret: str
    model_name: str
    leader_port: int  # the configured port, for rank 0 only; the others bind any free port


@dataclass(frozen=True)
class RankPuller:
    """What a decode rank needs to pull its heads: its group's id (the worker id) and the transfer settings."""

    group_id: str
    kv: KvTransferSettings
    secret: str
    model_name: str


def register_rank_kv(agent: RankAgent, pool: KVPool, staged: StagedKv) -> None:
    """Register kv.serve, kv.puller and kv.stop on this rank's agent (every rank of a group, at start)."""
    servers: list[KvTransferServer] = []
    clients: list[KvTransferClient] = []

    async def serve(job: RankServe) -> str:
        async def report(key: str, rank: int, ok: bool, group_pulls: int) -> None:
            del rank  # the event says which rank reports
            await agent.notify(SEND_ENDED, (key, ok, group_pulls))

        kv = job.kv
        _, server, address = await serve_rank_kv(
            agent,
            pool,
            agent.rank,
            report,
            host=kv.rpc_host,
            port=job.leader_port if agent.rank == 0 else 0,
            secret=job.secret,
            backend=kv.backend,
            timeout_s=kv.timeout_s,
            chunk_bytes=kv.chunk_bytes,
            fault_send_midway=kv.fault_send_midway,
            advertise_host=kv.advertise_host,
            model_name=job.model_name,
            tls=KvTls.load(*kv.tls_files),
            replay_capacity=kv.replay_cache_entries,
            shm_bytes=kv.shm_bytes,  # a decode rank on this host gets a shared segment, as with single workers
        )
        servers.append(server)
        return address

    async def puller(job: RankPuller) -> None:
        kv = job.kv
        client = KvTransferClient(
            rank_worker_id(job.group_id, agent.rank),
            secret=job.secret,
            backend=kv.backend,
            timeout_s=kv.timeout_s,
            model_name=job.model_name,
            tls=KvTls.load(*kv.tls_files),
            group_id=job.group_id,
            shared_memory=kv.shm_bytes > 0,  # PDSERVE_KV_SHM_BYTES=0 turns it off for group hand-offs too
            # no loans: a rank's KV is staged, then written by an op every rank runs, which must not fail midway
            # (a loan taken back under it would: borrow.py); a rank's pull goes through the segment
            borrow=False,
        )
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
