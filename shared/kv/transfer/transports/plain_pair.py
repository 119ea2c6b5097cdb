"""Transport: the collective pair, plain. The server announces shape, tag and chunk size and sends the pieces
(from the pool's blocks, or an export copy) over the pair's gloo or NCCL group; the client receives them into a
buffer of the announced shape. Every pair has it (the pair forms at Connect): it is last, and takes every pull.
"""

from __future__ import annotations

from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports import over_pair
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import announce, announced_layout, describe, num_pieces, receive_pieces
from shared.rpc import kv_transfer_pb2 as pb

NAME = "pair"


class PlainPairSender:
    name = NAME

    def __init__(self, sends: Sends) -> None:
        self.sends = sends

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        return None  # the pair itself is every Connect's

    async def send(self, job: SendJob) -> pb.PullReply:
        kv, chunk_bytes = job.kv, self.sends.settings.chunk_bytes
        if isinstance(kv, PoolKv):
            tag = job.slot.reserve_tags(kv.num_pieces(chunk_bytes))
            reply = announce(kv.layout, kv.num_tokens, kv.shape, tag, chunk_bytes, kv.runs, kv.first_block)
        else:
            tag = job.slot.reserve_tags(num_pieces(kv.blocks.numel(), kv.blocks.element_size(), chunk_bytes))
            reply = describe(kv, tag, chunk_bytes)
        over_pair.start_send(self.sends, job, kv, tag)
        return reply


class PlainPairReceiver:
    name = NAME

    def __init__(self, receives: Receives) -> None:
        self.receives = receives

    def prepare(self, link: Link, pull: Pull) -> Offer | None:
        return None

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival:
        source = announced_layout(reply, pull.layout)
        buffer = self.receives.buffers.take(tuple(reply.shape), pull.layout.torch_dtype)
        # The server is sending already: the same pieces, from the announced tag on.
        parts = receive_pieces(buffer, reply)
        return over_pair.receive(self.receives, link.pair, reply, source, buffer, parts, lambda kv: kv)

    def close(self) -> None:
        return None


def _connect(receives: Receives, reply: pb.ConnectReply, layout: KVLayout) -> PlainPairReceiver:
    return PlainPairReceiver(receives)


TRANSPORT = Transport(NAME, PlainPairSender, _connect)
