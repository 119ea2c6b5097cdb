"""The decode side's pairs (client.py): the record of one (`ClientPair`: its stub, group, carrier, receivers), and
how one is opened: the gRPC channel, the blocking join of our rank with the proofs, the same-host Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import grpc

from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.local_stream import LocalCall
from shared.kv.transfer.pair import DECODE_RANK, Pair, TransferBackend, local_address_towards, store_client
from shared.kv.transfer.pair_proof import PairProofs
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES
from shared.kv.transfer.transports.base import Receiver
from shared.kv.transfer.transports.receives import Link
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
# Pull answers given before any send starts: the pair is still clean after them.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # a message too big for gRPC, or the server's replay cache full
    }
)


@dataclass
class ClientPair:
    """One pair as the client knows it: the transports it took (receivers, in order) and how its pulls travel."""

    stub: pb_grpc.KvTransferStub
    link: Link  # the pair's group and the carrier of its pulls
    # NCCL matches send/recv by issue order, not tag: one transfer at a time on such a pair.
    order: asyncio.Lock | contextlib.nullcontext
    receivers: list[Receiver] = field(default_factory=list)  # the transports this pair took, in order

    @property
    def pair(self) -> Pair:
        return self.link.pair

    @property
    def pulls(self) -> PullStream:
        return self.link.pulls

    def receiver(self, name: str) -> Receiver | None:
        return next((r for r in self.receivers if r.name == name), None)


def open_channel(address: str, tls: KvTls | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def join_pair(reply: pb.ConnectReply, backend: TransferBackend, timeout_s: float, proofs: PairProofs) -> Pair:
    """Blocking: reach the prefill worker's store, build our rank of the pair's group, exchange proofs."""
    store = store_client(reply.store_host, reply.store_port, timeout_s)
    local = local_address_towards(reply.store_host) if backend is TransferBackend.GLOO else None
    pair = Pair.join(backend, store, reply.pair_id, DECODE_RANK, timeout_s, local)
    proofs.confirm(pair)  # PairRefused (pair closed): the rank 0 we reached is not the prefill worker
    return pair


async def open_local(reply: pb.ConnectReply, wanted: bool, timeout_s: float) -> LocalCall | None:
    """The server's Unix socket for a pair's pulls, if it offered one (same host), we want it and reach it;
    None: gRPC."""
    if not (reply.local_stream and wanted):
        return None
    try:
        return await LocalCall.connect(reply.local_stream, MAX_MESSAGE_BYTES, timeout_s)
    except (OSError, TimeoutError) as e:  # e.g. another network namespace: the abstract name is not here
        log.info("the prefill worker's local pull stream is not reachable (%s): pulls go over gRPC", e)
        return None


def transfer_error(error: Exception, what: str) -> KvTransferError:
    timed_out = "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower()
    reason = FailureReason.TIMEOUT if timed_out else FailureReason.UNAVAILABLE
    return KvTransferError(reason, f"{what}: {error}")
