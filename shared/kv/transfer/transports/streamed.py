"""Transport: a layer-streamed send over the collective pair (layer_stream.py). Whether a send streams is a
property of the KV the source hands out, not a setting: a `StreamedPoolKv` (its last prefill chunk still running)
is sent layer by layer as the forward pass writes each, then its first token as a trailer; the reply says
`layer_streamed`, and the client receives one more piece, the trailer, and returns a `StreamedKv`. Such a KV
goes over the pair only (it is never lent, written into a segment, or sent into posted receives).
"""

from __future__ import annotations

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.layer_stream import StreamedKv, StreamedPoolKv, receive_parts
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports import over_pair
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import announce, announced_layout, receive_pieces
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics

NAME = "streamed"


class StreamedSender:
    name = NAME

    def __init__(self, sends: Sends) -> None:
        self.sends = sends

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        return None  # nothing to negotiate: any pair receives a reply that says `layer_streamed`

    async def send(self, job: SendJob) -> pb.PullReply | None:
        kv, settings = job.kv, self.sends.settings
        if not isinstance(kv, StreamedPoolKv):
            return None
        tag = job.slot.reserve_tags(kv.num_pieces(settings.chunk_bytes))
        reply = announce(kv.layout, kv.num_tokens, kv.shape, tag, settings.chunk_bytes, kv.runs, kv.first_block)
        kv.wait_s, reply.layer_streamed = settings.timeout_s, True
        self.sends.stats.streamed_pulls += 1
        metrics.KV_LAYER_STREAMED.labels(*self.sends.labels).inc()
        over_pair.start_send(self.sends, job, kv, tag)
        return reply


class StreamedReceiver:
    name = NAME

    def __init__(self, receives: Receives) -> None:
        self.receives = receives

    def prepare(self, link: Link, pull: Pull) -> Offer | None:
        return None

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival | None:
        if not reply.layer_streamed:
            return None
        source = announced_layout(reply, pull.layout)
        buffer = self.receives.buffers.take(tuple(reply.shape), pull.layout.torch_dtype)
        # The server sends as the prefill writes each layer, then the first token (the trailer's piece).
        parts, trailer = receive_parts(receive_pieces(buffer, reply), reply)
        assert trailer is not None

        def done(kv: KVExport) -> StreamedKv:  # every layer and the first token arrived: decode may begin
            self.receives.stats.streamed_pulls += 1
            return StreamedKv(kv.layout, kv.num_tokens, kv.blocks, first_block=kv.first_block, parts=kv.parts,
                              first_token=int(trailer[0]))  # fmt: skip

        return over_pair.receive(self.receives, link.pair, reply, source, buffer, parts, done)

    def close(self) -> None:
        return None


def _connect(receives: Receives, reply: pb.ConnectReply, layout: KVLayout) -> StreamedReceiver:
    return StreamedReceiver(receives)


TRANSPORT = Transport(NAME, StreamedSender, _connect)
