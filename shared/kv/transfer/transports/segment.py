"""Transport: a shared-memory segment per same-host pair (shm.py, segment_send.py). Connect gives a pair whose
client proved the same host identity a segment of `shm_bytes`; the client maps it (before the pair forms: the
server unlinks its name then) and offers a region of it with each Pull; a KV that fits is gathered there by the
server, once, and the client's result is a view of it (no copy here), whose region is freed with the tensor.
"""

from __future__ import annotations

import logging
import math

import grpc

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.rpc_calls import short
from shared.kv.transfer.segment_send import copy_into_region, fits, shape_of
from shared.kv.transfer.shm import Regions, Segment
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import announce, announced_layout, received
from shared.rpc import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)
NAME = "segment"
# A shared-memory send of up to this size is copied on the loop (~5 ms at 13 GB/s; torch releases the GIL, the
# engine thread runs on): the hops to a send thread and back cost ~0.9 ms of a 4k-token pull's 6.7 (AMD EPYC).
SHM_COPY_ON_LOOP_BYTES = 64 << 20


class SegmentSender:
    name = NAME

    def __init__(self, sends: Sends) -> None:
        self.sends = sends

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        if hello.host_id != self.sends.settings.host_id:
            return
        try:
            segment = await self.sends.run_in_thread(Segment.create, self.sends.settings.shm_bytes)
        except OSError as e:
            log.warning("no shared KV segment for %s (%s): its pulls go over the socket", short(slot.worker_id), e)
            return
        slot.segment = segment
        self.sends.stats.segments += 1
        reply.shm_name, reply.shm_bytes = segment.name, segment.nbytes
        if slot.joining.done():  # the pair formed or failed already: its callback found no segment to unlink
            segment.unlink()

    async def send(self, job: SendJob) -> pb.PullReply | None:
        """The shared-memory send: one gather of the blocks into the region the puller offered, then the reply
        says it is there. The KV is freed either way, as after a send over the pair."""
        kv, request, segment = job.kv, job.request, job.slot.segment
        if isinstance(kv, StreamedPoolKv) or not fits(segment, request.shm_offset, request.shm_capacity, kv):
            return None
        assert segment is not None
        settings, error, shape = self.sends.settings, None, shape_of(kv)
        try:
            region = segment.view(request.shm_offset, shape, kv.layout.torch_dtype)
            if kv.nbytes <= SHM_COPY_ON_LOOP_BYTES and not settings.faults:
                copy_into_region(kv, region)  # the loop waits a few ms; a send thread costs two hops more
            else:
                faults = (settings.fault_send_midway, settings.fault_send_stall_s)
                await self.sends.run_in_thread(copy_into_region, kv, region, *faults)
            self.sends.stats.shm_pulls += 1
            self.sends.sent(job, kv.nbytes)
        except Exception as e:
            error = self.sends.failed(job, e, "shared-memory send")
        finally:
            await self.sends.end(job, error)
        if error is not None:
            await job.context.abort(grpc.StatusCode.UNAVAILABLE, error)
        reply = announce(kv.layout, kv.num_tokens, shape, 0, 0, first_block=kv.first_block, groups=kv.parts)
        reply.shm_bytes = kv.nbytes
        return reply


class RegionOffer:
    """A region of the segment offered with one Pull: kept for what the server wrote there, else freed."""

    def __init__(self, regions: Regions, offset: int, capacity: int) -> None:
        self.regions, self.offset, self.capacity = regions, offset, capacity
        self._open = True

    def answered(self, reply: pb.PullReply) -> None:
        # what the server wrote stays reserved until its tensor is gone; the rest is free again
        self._open = False
        self.regions.keep(self.offset, self.capacity, reply.shm_bytes)

    def withdraw(self) -> bool:
        if self._open:
            self._open = False
            self.regions.free(self.offset, self.capacity)
        return False


class SegmentReceiver:
    name = NAME

    def __init__(self, receives: Receives, segment: Segment) -> None:
        self.receives = receives
        self.segment = segment
        self.regions = Regions(segment.nbytes)  # who uses which part of it

    def prepare(self, link: Link, pull: Pull) -> RegionOffer:
        offset, capacity = self.regions.reserve()
        pull.request.shm_offset, pull.request.shm_capacity = offset, capacity
        return RegionOffer(self.regions, offset, capacity)

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival | None:
        """The KV the server wrote into our segment: a view of it, whose region is freed with the tensor."""
        if not reply.shm_bytes or not isinstance(offer, RegionOffer):
            return None
        source = announced_layout(reply, pull.layout)
        regions, offset, used = self.regions, offer.offset, -(-reply.shm_bytes // 64) * 64
        expected = math.prod(reply.shape) * source.torch_dtype.itemsize
        try:
            if reply.shm_bytes != expected:
                raise ValueError(f"{reply.shm_bytes} bytes written for {list(reply.shape)}")
            blocks = self.segment.view(offset, tuple(reply.shape), source.torch_dtype,
                                       lambda: regions.free(offset, used))  # fmt: skip
        except ValueError as e:
            regions.free(offset, used)
            raise KvTransferError(FailureReason.PROTOCOL, f"{pull.request.request_id!r} in shared memory: {e}") from e
        stats = self.receives.stats
        stats.pulls += 1
        stats.shm_pulls += 1
        stats.bytes_received += reply.shm_bytes
        kv: KVExport = received(reply, source, blocks)
        return Arrival(lambda: kv)

    def close(self) -> None:
        self.segment.close()  # unmapped now unless a pulled tensor still lives on it


def _connect(receives: Receives, reply: pb.ConnectReply, layout: KVLayout) -> SegmentReceiver | None:
    """Map (and unlink) the segment the server offered; None, the socket path, if that fails."""
    if not reply.shm_name:
        return None
    try:
        segment = Segment.attach(reply.shm_name, reply.shm_bytes)
    except (OSError, ValueError) as e:
        log.warning("could not map the shared KV segment %r (%s): pulls go over the socket", reply.shm_name, e)
        return None
    return SegmentReceiver(receives, segment)


def _server(sends: Sends) -> SegmentSender | None:
    return SegmentSender(sends) if sends.settings.host_id and sends.settings.shm_bytes else None


TRANSPORT = Transport(NAME, _server, _connect)
