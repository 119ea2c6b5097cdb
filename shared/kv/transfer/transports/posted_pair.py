"""Transport: the collective pair, pre-posted (gloo only; posted.py has the cut both sides agree on). Connect
tells the client the source's block size and chunk size; given the KV location's token count, the client posts
its receives before the Pull and names them in it; the server, if the KV is exactly that, sends into them at once
(`PullReply.posted`). Receives that go unused (the Pull refused or failed, another transport answered) are
abandoned at once, and the pair with them (gloo still lists them): the next pull forms a new pair.
"""

from __future__ import annotations

import asyncio
import contextlib

from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import KvTransferError
from shared.kv.transfer.pair import TransferBackend
from shared.kv.transfer.posted import (
    POSTED_TAG_BASE,
    PostedPull,
    can_post,
    posted_cut,
    posted_kv,
    posted_pieces,
    posted_shape,
)
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports import over_pair
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import MAX_PIECES, MAX_TAG, announce, announced_layout
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics

NAME = "posted"


class PostedSender:
    name = NAME

    def __init__(self, sends: Sends) -> None:
        self.sends = sends

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        # NCCL matches in issue order, not by tag: its client posts after the reply
        if self.sends.settings.backend is TransferBackend.GLOO:
            reply.posted_pulls, reply.chunk_bytes = True, self.sends.settings.chunk_bytes
            reply.block_size = self.sends.layout.block_size

    async def send(self, job: SendJob) -> pb.PullReply | None:
        chunk_bytes = self.sends.settings.chunk_bytes
        into = posted_kv(job.kv, job.request.posted, chunk_bytes) if job.request.HasField("posted") else None
        if into is None:  # no receives posted, or not for this KV: ignored, they are the client's to abandon
            return None
        tag = job.request.posted.tag
        reply = announce(into.layout, into.num_tokens, into.shape, tag, chunk_bytes, into.runs)
        reply.posted = True
        self.sends.stats.posted_pulls += 1
        metrics.KV_POSTED_PULLS.labels(*self.sends.labels).inc()
        over_pair.start_send(self.sends, job, into, tag)
        return reply


class PostedOffer:
    """A pull's posted receives: waited for once the reply says the server sends into them, else abandoned."""

    def __init__(self, receives: Receives, posted: PostedPull) -> None:
        self.receives = receives
        self.posted = posted
        self._open = True

    def answered(self, reply: pb.PullReply) -> None:
        return None

    def withdraw(self) -> bool:
        if self._open:  # no wait, the buffer dropped, not reused: gloo still lists them until the pair is gone
            self._open = False
            self.posted.abandon()
            self.receives.stats.abandoned_posts += 1
        return True


class PostedReceiver:
    name = NAME

    def __init__(self, receives: Receives, block_size: int, chunk_bytes: int) -> None:
        self.receives = receives
        self.block_size = block_size  # the source's, and its chunk size: the cut is known without a reply
        self.chunk_bytes = chunk_bytes
        self.next_posted_tag = POSTED_TAG_BASE

    def reserve_posted_tags(self, count: int) -> int:
        """The first of `count` consecutive tags of the decode side's range for a pull's posted receives."""
        if self.next_posted_tag + count > MAX_TAG:  # tags only need to differ among transfers in flight
            self.next_posted_tag = POSTED_TAG_BASE
        first, self.next_posted_tag = self.next_posted_tag, self.next_posted_tag + count
        return first

    def prepare(self, link: Link, pull: Pull) -> PostedOffer | None:
        """Post the receives of a pull of `num_tokens` tokens before its Pull, where the pair and layout allow."""
        num_tokens, layout = pull.num_tokens, pull.layout
        # None when a shared region is offered or the KV is to be borrowed in place (those receivers come first):
        # the KV is meant to go there, and receives left posted would cost the pair (withdraw drops it).
        if pull.request.shm_capacity or pull.request.borrow or not num_tokens or num_tokens < 1 or not can_post(layout):
            return None
        shape = posted_shape(layout, self.block_size, num_tokens)
        cut = posted_cut(shape, layout.torch_dtype.itemsize)
        count = posted_pieces(shape, cut, layout.torch_dtype.itemsize, self.chunk_bytes)
        if count > MAX_PIECES:
            return None
        buffer = self.receives.buffers.take(shape, layout.torch_dtype)
        tag = self.reserve_posted_tags(count)
        try:
            posted = PostedPull.post(link.pair, buffer, tag, num_tokens, cut, self.chunk_bytes)
        except RuntimeError:  # the pair closed under us (a failed transfer): the Pull will say ABORTED
            return None
        pull.request.posted.CopyFrom(posted.message)
        return PostedOffer(self.receives, posted)

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival | None:
        if not (reply.posted and isinstance(offer, PostedOffer)):
            return None
        posted = offer.posted  # the bytes are on their way into our buffer already
        try:
            source = announced_layout(reply, pull.layout)
            posted.check(reply)
        except KvTransferError:  # once the send it started is over: the server checked the sizes, it fills them
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(self.receives.executor, posted.transfer.wait)
            raise
        offer._open = False  # taken: waited for, never abandoned

        def done(kv):
            self.receives.stats.posted_pulls += 1
            return kv

        return Arrival(lambda: done(over_pair.arrived(self.receives, reply, source, posted.buffer)),
                       posted.transfer.wait)  # fmt: skip

    def close(self) -> None:
        return None


def _connect(receives: Receives, reply: pb.ConnectReply, layout: KVLayout) -> PostedReceiver | None:
    if not (reply.posted_pulls and receives.backend is TransferBackend.GLOO and reply.block_size):
        return None
    return PostedReceiver(receives, reply.block_size, reply.chunk_bytes)


TRANSPORT = Transport(NAME, PostedSender, _connect)
