"""Transport: the borrowed pool (borrow.py has the loans and why they are safe). A same-host pair whose Pulls go
over the server's Unix socket is offered the prefill pool (a memfd) at Connect; the client maps it read-only and
asks to borrow; the server answers a whole, complete KV with its block ids and keeps the send open until the
client's release (or ends the connection first); the client's result is a `BorrowedKv`, copied by the import
straight from the mapped pool into its own: one copy in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import torch

from shared.engine.borrowed_kv import BorrowedKv
from shared.engine.kv_pool import KVLayout
from shared.engine.shared_pool import PoolHandle, attach_pool
from shared.kv.transfer.borrow import Lender, pool_handle, pool_memory
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.segment_send import shape_of
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import announce, announced_layout
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics

log = logging.getLogger(__name__)
NAME = "borrowed"


class BorrowedSender:
    name = NAME

    def __init__(self, sends: Sends, pool: PoolHandle) -> None:
        self.sends = sends
        self.pool = pool

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        # lent only over the Unix socket (its release, its end): offered where the server offers that carrier
        if reply.local_stream and hello.host_id == self.sends.settings.host_id:
            reply.pool.CopyFrom(pool_memory(self.pool))
            reply.block_size = self.sends.layout.block_size

    async def send(self, job: SendJob) -> pb.PullReply | None:
        """Answer with the request's block ids: the puller copies them from the mapped pool (borrow.py). The send
        stays open, the blocks held, until the release message, or until the connection ended (revoked)."""
        kv, lender = job.kv, job.lender
        if not (job.request.borrow and lender is not None and not lender.revoked and job.request_id not in lender):
            return None
        if not self._lendable(kv):
            return None
        assert isinstance(kv, PoolKv)
        self._lend(lender, job, kv)
        self.sends.stats.borrowed_pulls += 1
        reply = announce(kv.layout, kv.num_tokens, shape_of(kv), 0, 0, first_block=kv.first_block)
        reply.borrowed_blocks.extend(kv.block_ids)
        return reply

    def _lendable(self, kv) -> bool:
        """A whole request's blocks in the shared pool, complete (not a layer stream), and no test fault to inject
        (those act on copies)."""
        if not isinstance(kv, PoolKv) or isinstance(kv, StreamedPoolKv):
            return False
        return kv.pool.memory is not None and not self.sends.settings.faults

    def _lend(self, lender: Lender, job: SendJob, kv: PoolKv) -> None:
        sends = self.sends

        async def end(released: bool) -> None:
            error = None
            if released:
                sends.sent(job, kv.nbytes)
            else:
                sends.stats.failed_sends += 1
                metrics.KV_TRANSFER_FAILURES.labels(*sends.labels, "loan_revoked").inc()
                error = "the connection ended before the borrowed blocks were released"
            await sends.end(job, error)

        lender.lend(job.request_id, end)


class BorrowedReceiver:
    name = NAME

    def __init__(self, receives: Receives, handle: PoolHandle, layout: KVLayout, block_size: int) -> None:
        self.receives = receives
        self._handle = handle
        self._source = dataclasses.replace(layout, block_size=block_size, kv_heads=())
        self._mapped = False
        self.pool: torch.Tensor | None = None  # the prefill pool, mapped read-only at the pair's first pull
        self._releasing: set[asyncio.Future[None]] = set()  # release messages being written

    def prepare(self, link: Link, pull: Pull) -> Offer | None:
        # Only over the Unix socket (the release, the loan's end); a whole KV may be lent in place (the region
        # stays offered, for what the server cannot lend: a stream)
        if link.local is None:
            return None
        if not self._mapped:
            self._mapped = True
            self.pool = self._map()
        pull.request.borrow = self.pool is not None and not pull.request.kv_head_count
        return None

    def _map(self) -> torch.Tensor | None:
        """The prefill pool, mapped read-only; None (pulls through the segment) when it cannot be (logged)."""
        handle, source = self._handle, self._source
        try:
            return attach_pool(handle, source.block_shape(handle.num_blocks), source.torch_dtype)
        except (OSError, ValueError) as e:  # another pid namespace or user, the process gone, not that pool
            log.warning("could not map the prefill worker's KV pool (%s): pulls go through the segment", e)
            return None

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival | None:
        """The KV the server lent in place: its blocks of the mapped pool, released once imported (borrow.py)."""
        if not reply.borrowed_blocks:
            return None
        source = announced_layout(reply, pull.layout)
        pool, local, blocks = self.pool, link.local, list(reply.borrowed_blocks)
        request_id, loop = pull.request.request_id, asyncio.get_running_loop()
        assert local is not None

        def release() -> None:  # from any thread (the import's, or the garbage collector's)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the connection went with it
                loop.call_soon_threadsafe(self._release, link, request_id)

        if pool is None or pool.shape[3] != source.block_size or len(blocks) != reply.shape[2]:
            release()
            raise KvTransferError(FailureReason.PROTOCOL, f"{request_id!r} lent as blocks that are not its shape")
        if max(blocks) >= pool.shape[2]:
            release()
            raise KvTransferError(FailureReason.PROTOCOL, f"{request_id!r} lent as blocks outside the mapped pool")
        stats = self.receives.stats
        stats.pulls += 1
        stats.borrowed_pulls += 1
        metrics.KV_BORROWED_PULLS.labels(self.receives.model_name, "decode").inc()
        kv = BorrowedKv(source, reply.num_tokens, pool, blocks, first_block=reply.first_block,
                        still_lent=local.alive, release=release)  # fmt: skip
        stats.bytes_received += kv.nbytes
        return Arrival(lambda: kv)

    def _release(self, link: Link, request_id: str) -> None:
        """On the loop: send the release of a borrowed KV (kept until written: a task is only weakly held)."""
        task = asyncio.ensure_future(link.pulls.release(request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def close(self) -> None:
        self.pool = None  # unmapped once no borrowed KV still reads it


def _connect(receives: Receives, reply: pb.ConnectReply, layout: KVLayout) -> BorrowedReceiver | None:
    if not (receives.borrow and reply.HasField("pool") and reply.block_size and reply.local_stream):
        return None
    try:
        handle = pool_handle(reply.pool)
    except ValueError as e:
        log.warning("could not map the prefill worker's KV pool (%s): pulls go through the segment", e)
        return None
    return BorrowedReceiver(receives, handle, layout, reply.block_size)


def _server(sends: Sends) -> BorrowedSender | None:
    pool = sends.settings.shared_pool
    return BorrowedSender(sends, pool) if pool is not None and sends.settings.host_id else None


TRANSPORT = Transport(NAME, _server, _connect)
