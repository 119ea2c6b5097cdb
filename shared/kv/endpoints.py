"""A rank's transfer server and client, built from the one KV settings object, the same for every rank.

A single worker's rank and every rank of a worker group get their `KvTransferServer` / `KvTransferClient`
here, from `KvTransferSettings` itself (a follower receives it msgspec-encoded, rank_agents.py): no knob is
copied field by field, so none can be left out for one kind of worker (fault injection, the shared-memory
segment and Unix socket of a same-host pair, TLS, the replay cache). What differs per rank is passed apart:
which port it binds, its pool (a same-host puller maps it), its send stream, and whether it borrows.
"""

from __future__ import annotations

from shared.engine.shared_pool import PoolHandle
from shared.kv.transfer import KvTransferClient, KvTransferServer
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.source import KvSource
from shared.settings import KvTransferSettings

RANK_SEPARATOR = "#r"


def rank_worker_id(group_id: str, rank: int) -> str:
    """Rank `rank` of decode group `group_id` as a transfer peer (its pairs, its connect tickets)."""
    return f"{group_id}{RANK_SEPARATOR}{rank}"


def group_of(worker_id: str) -> str:
    """The group a rank's transfer id belongs to; a single worker's id is its own group."""
    group, sep, rank = worker_id.rpartition(RANK_SEPARATOR)
    return group if sep and group and rank.isdigit() else worker_id


def kv_server(
    kv: KvTransferSettings,
    source: KvSource,
    *,
    secret: str,
    model_name: str,
    port: int,
    send_stream: SendStream | None = None,
    shared_pool: PoolHandle | None = None,
) -> KvTransferServer:
    """A rank's transfer server over `source`. port: kv.rpc_port for the worker's advertised rank, 0 for the
    others. shared_pool: the rank's pool when it lives in shared memory (a single prefill worker's, kv_share_pool:
    a group's never are): a same-host puller borrows its blocks. A decode rank's pull ticket names its group
    (`group_of`), so one ticket of a decode group covers its ranks."""
    return KvTransferServer(
        kv.rpc_host,
        port,
        source=source,
        secret=secret,
        backend=kv.backend,
        timeout_s=kv.timeout_s,
        chunk_bytes=kv.chunk_bytes,
        fault_send_midway=kv.fault_send_midway,
        fault_send_stall_s=kv.fault_send_stall_s,
        advertise_host=kv.advertise_host,
        model_name=model_name,
        send_stream=send_stream,
        tls=KvTls.load(*kv.tls_files),
        replay_capacity=kv.replay_cache_entries,
        ticket_holder=group_of,
        shm_bytes=kv.shm_bytes,
        shared_pool=shared_pool,
    )


def kv_client(
    kv: KvTransferSettings, worker_id: str, *, secret: str, model_name: str, group_id: str | None = None
) -> KvTransferClient:
    """A rank's transfer client. group_id: the decode group a rank of several belongs to (its transfer id is
    `<group>#r<rank>`, its pull tickets name the group). Such a rank never borrows a prefill pool: its KV is
    staged, then written by an op every rank runs, which a loan taken back mid-copy must not fail (borrow.py);
    its pulls take the same-host pair's segment instead. A rank of one borrows where the prefill pool is lent."""
    return KvTransferClient(
        worker_id,
        secret=secret,
        backend=kv.backend,
        timeout_s=kv.timeout_s,
        model_name=model_name,
        tls=KvTls.load(*kv.tls_files),
        group_id=group_id,
        shared_memory=kv.shm_bytes > 0,  # kv_shm_bytes=0 turns same-host paths off for every rank
        borrow=group_id is None,
    )
