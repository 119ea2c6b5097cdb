"""Decode side of the KV transfer plane: pull a request's KV from the prefill worker that holds it.

The first pull from an address negotiates a pair (Connect RPC, then both sides join a two-rank group); later pulls
reuse it. A pull is one Pull (a message on the pair's PullStream, pull_stream.py: the server exports, announces
shape/dtype/tag/chunk size and starts sending) and the recv of its pieces into a buffer of the announced shape: new
memory, or memory a caller handed back with `recycle` after importing an earlier pull. Each call carries a ticket
this client mints with the cluster secret for its own worker id (shared/kv/tickets.py), a fresh one per call (the
server accepts each ticket once: a retry mints anew). With `tls` the channel is TLS, presenting this worker's
certificate (channel_tls.py). A joined pair is used only once the prefill side proved it holds the cluster secret
(pair_proof.py). On one host (same host identity, shm.py) the server also offers a shared-memory segment with the
pair: each pull then reserves a region of it, and a KV that fits arrives there (the result is a view of it, no copy
here), else over the pair as usual. Blocking joins and recv waits run in this client's thread pool, so the decode
loop keeps stepping while KV arrives; gloo recvs are posted from the loop as soon as the reply is in (pair.py), so
only their wait takes a thread; given the token count, they are posted before the Pull itself (posted.py), and
given up at once if the server does not use them. Every failure surfaces as KvTransferError; one that may have left
the pair mid-transfer closes and forgets it, so the next pull negotiates a fresh pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from shared.engine.borrowed_kv import BorrowedKv
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.engine.shared_pool import attach_pool
from shared.kv.tickets import Tickets
from shared.kv.transfer.borrow import pool_handle
from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.heads import head_fields
from shared.kv.transfer.layer_stream import StreamedKv, receive_parts
from shared.kv.transfer.local_stream import LocalCall
from shared.kv.transfer.pair import (
    DECODE_RANK,
    Pair,
    TransferBackend,
    check_backend,
    local_address_towards,
    store_client,
)
from shared.kv.transfer.pair_proof import PairProofs
from shared.kv.transfer.posted import (
    POSTED_TAG_BASE,
    PostedPull,
    can_post,
    posted_cut,
    posted_pieces,
    posted_shape,
)
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES
from shared.kv.transfer.shm import Regions, Segment, host_identity
from shared.kv.transfer.wire import MAX_PIECES, MAX_TAG, announced_layout, receive_pieces, received
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc
from shared.telemetry import metrics, tracing

log = logging.getLogger(__name__)
MAX_BLOCKING_THREADS = 32  # joins + recv waits at once; more queue for a free thread
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
class ClientStats:
    connects: int = 0  # pairs joined: one process group constructed each
    pulls: int = 0  # pulls completed
    shm_pulls: int = 0  # of which arrived through a shared segment
    streamed_pulls: int = 0  # of which were sent layer by layer, the first token after them (layer_stream.py)
    posted_pulls: int = 0  # of which arrived in receives posted before the Pull (posted.py)
    abandoned_posts: int = 0  # pulls whose posted receives went unused (refused, failed, ignored): pair dropped
    local_pulls: int = 0  # Pulls answered over a same-host pair's Unix socket, not gRPC (local_stream.py)
    borrowed_pulls: int = 0  # of which lent in place: the blocks are copied from the prefill pool (borrow.py)
    bytes_received: int = 0


@dataclass
class _Connection:
    stub: pb_grpc.KvTransferStub
    pair: Pair
    pulls: PullStream  # this pair's pulls, as messages of one stream (pull_stream.py)
    # NCCL matches send/recv by issue order, not tag: one transfer at a time on such a pair.
    order: asyncio.Lock | contextlib.nullcontext
    segment: Segment | None = None  # same host: the pair's shared memory, and who uses which part of it
    regions: Regions | None = None
    # Pre-posted pulls (posted.py): the server takes them, with the source's block size and chunk size.
    posting: pb.ConnectReply | None = None
    next_posted_tag: int = POSTED_TAG_BASE
    local: LocalCall | None = None  # `pulls` runs over the server's Unix socket (local_stream.py), not gRPC
    pool: torch.Tensor | None = None  # the prefill pool, mapped read-only: pulls borrow blocks of it (borrow.py)

    def reserve_posted_tags(self, count: int) -> int:
        """The first of `count` consecutive tags of the decode side's range for a pull's posted receives."""
        if self.next_posted_tag + count > MAX_TAG:  # tags only need to differ among transfers in flight
            self.next_posted_tag = POSTED_TAG_BASE
        first, self.next_posted_tag = self.next_posted_tag, self.next_posted_tag + count
        return first


class _StalePair(KvTransferError):
    """The server no longer knows our pair (it restarted, or dropped the pair after a failed send)."""


class KvTransferClient:
    """One decode worker's puller; holds one pair per prefill worker address. Use from one event loop."""

    def __init__(
        self,
        worker_id: str,
        *,
        secret: bytes | str,
        backend: TransferBackend | str = "gloo",
        timeout_s: float = 30.0,
        device: str | None = None,
        recv_cache_bytes: int = 256 << 20,
        model_name: str = "",
        tls: KvTls | None = None,
        group_id: str | None = None,
        shared_memory: bool = True,
        local_stream: bool = True,
        borrow: bool = True,
    ) -> None:
        """secret: the cluster secret (at least 16 bytes) this client signs its tickets with. timeout_s
        bounds each RPC, forming a pair, and each transfer's receive. tls: TLS with this worker's certificate
        (None: plaintext gRPC). group_id: the decode group whose pull tickets this rank's pulls carry
        (shared/kv/rank_transfer.py); None: worker_id's own. shared_memory: take a shared segment from a
        prefill worker on this host (False: every pull over the pair). local_stream: send a same-host pair's
        pulls over the server's Unix socket when it offers one (False: the PullStream RPC; for comparison). borrow:
        map a same-host prefill worker's pool when it offers it, and borrow a request's blocks in place (the
        result is a BorrowedKv: the import copies from that pool; release it once imported, `recycle` does);
        False: through the segment."""
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.worker_id = worker_id
        self._tickets = Tickets(secret)
        self._proofs = PairProofs(secret)
        self.tls = tls
        self.group_id = group_id or worker_id
        self.backend = check_backend(backend)
        self.timeout_s = timeout_s
        self.model_name = model_name  # labels this client's spans and metrics
        self.device = device or self.backend.device  # where received KV lands (NCCL: the decode GPU)
        self.stats = ClientStats()
        # gloo pairs only: NCCL moves GPU memory, which a host segment would only add a copy to
        self.host_id = host_identity() if shared_memory and self.backend is TransferBackend.GLOO else ""
        self.local_stream = local_stream
        self.borrow = borrow
        self._buffers = BufferPool(recv_cache_bytes, self.device)  # what `recycle` hands back, for reuse
        self._executor = ThreadPoolExecutor(MAX_BLOCKING_THREADS, thread_name_prefix="kv-recv")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._connections: dict[str, asyncio.Task[_Connection]] = {}
        self._releasing: set[asyncio.Future[None]] = set()  # release messages of borrowed KV being written

    async def pull(
        self, address: str, request_id: str, layout: KVLayout, group_pulls: int = 0, num_tokens: int | None = None
    ) -> KVExport:
        """Fetch the KV of `request_id` from the prefill worker at `address`; `layout` is the receiving
        engine's (block size may differ: the result carries the source's, `reblock` re-cuts); a layout naming
        `kv_heads` pulls only those (contiguous) heads from a group rank, one of `group_pulls`. The prefill
        side frees its blocks once the bytes are out. num_tokens: how many tokens the KV covers, when known (the
        KV location's count): the receives are then posted before the Pull (posted.py); a wrong count only
        costs the pair (the server ignores such receives, the KV arrives as without). Raises KvTransferError
        (see its `reason`).
        Traced as a `pull_kv` span (child of the current one) whose context travels in the gRPC metadata."""
        labels = (self.model_name, "decode")
        started = time.perf_counter()
        attributes = {tracing.REQUEST_ID: request_id, tracing.KV_PEER: address}
        with tracing.tracer.start_as_current_span(
            f"{tracing.PULL_KV} {self.model_name}", kind=tracing.trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            try:
                try:
                    kv = await self._pull_once(address, request_id, layout, group_pulls, num_tokens)
                except _StalePair:  # a new pair, once; a second stale answer propagates as UNAVAILABLE
                    kv = await self._pull_once(address, request_id, layout, group_pulls, num_tokens)
            except KvTransferError as e:
                metrics.KV_TRANSFER_FAILURES.labels(*labels, e.reason.value).inc()
                span.set_attribute(tracing.KV_OUTCOME, f"failed: {e.reason.value}")
                raise
            elapsed = time.perf_counter() - started
            metrics.KV_TRANSFER_SECONDS.labels(*labels).observe(elapsed)
            metrics.KV_TRANSFER_BYTES.labels(*labels).inc(kv.nbytes)
            span.set_attributes(
                {
                    tracing.KV_BYTES: kv.nbytes,
                    tracing.KV_TOKENS: kv.num_tokens,
                    tracing.KV_DURATION: elapsed,
                    tracing.KV_OUTCOME: "pulled",
                }
            )
            return kv

    def recycle(self, kv: KVExport) -> None:
        """Optional: hand back a pulled KVExport once its KV is imported, so later pulls receive into the
        same memory instead of faulting in fresh pages. Neither `kv` nor its tensor may be used afterwards.
        (A KV that came through shared memory frees its region when its tensor is gone, recycled or not.) A
        borrowed KV is released: the prefill worker frees its blocks."""
        if isinstance(kv, BorrowedKv):
            kv.release()
            return
        self._buffers.give_back(kv.blocks)

    def shm_free_bytes(self, address: str) -> int | None:
        """Free bytes of the shared segment with `address` (None: no segment); all of it once every
        tensor that arrived through it is gone."""
        task = self._connections.get(address)
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        regions = task.result().regions
        return None if regions is None else regions.free_bytes

    async def close(self) -> None:
        """Drop every pair and channel. Pulls still in flight fail."""
        for task in self._connections.values():
            task.cancel()
            if task.done() and not task.cancelled() and task.exception() is None:
                conn = task.result()
                conn.pulls.close()
                conn.pair.close()
                if conn.segment is not None:
                    conn.segment.close()
        self._connections.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _pull_once(
        self, address: str, request_id: str, layout: KVLayout, group_pulls: int, num_tokens: int | None
    ) -> KVExport:
        conn = await self._connection(address, layout)
        request = pb.PullRequest(
            request_id=request_id,
            ticket=self._tickets.mint(self.group_id, request_id),
            decode_worker_id=self.worker_id,
            pair_id=conn.pair.pair_id,
            layout_fingerprint=layout.fingerprint,
            **head_fields(layout, group_pulls),
        )
        offset, capacity = conn.regions.reserve() if conn.regions is not None else (0, 0)
        request.shm_offset, request.shm_capacity = offset, capacity
        # A whole KV may be lent in place; the region stays offered, for what the server cannot lend (a stream)
        request.borrow = conn.pool is not None and not request.kv_head_count
        async with conn.order:
            # No receives posted when a shared region is offered: the KV is meant to arrive there.
            posted = self._post(conn, layout, num_tokens) if not capacity else None
            if posted is not None:
                request.posted.CopyFrom(posted.message)
            call = conn.pulls.pull(request, tracing.grpc_metadata(), self.timeout_s)
            try:
                reply = await self._call(address, conn, call, "Pull")
            except BaseException as e:
                if conn.regions is not None:
                    conn.regions.free(offset, capacity)
                if posted is not None:  # refused or failed: nothing will fill them (posted.py)
                    self._forget_posted(address, conn, posted)
                elif isinstance(e, asyncio.CancelledError):
                    # The server handles the message all the same and may start a send nobody receives:
                    # closing the pair fails that send at once (and frees its KV) instead of at its timeout.
                    self._forget(address, conn)
                raise
            if conn.local:
                self.stats.local_pulls += 1
                metrics.KV_LOCAL_PULLS.labels(self.model_name, "decode").inc()
            if conn.regions is not None:  # what the server wrote stays reserved until its tensor is gone
                conn.regions.keep(offset, capacity, reply.shm_bytes)
            try:
                if posted is not None and reply.posted:  # the bytes are on their way into our buffer already
                    source = await self._check_posted(posted, reply, layout)
                    buffer, trailer, finish = posted.buffer, None, posted.transfer.wait
                else:
                    source = announced_layout(reply, layout)
                    if reply.borrowed_blocks:
                        return self._borrowed(conn, reply, source, request_id)
                    if reply.shm_bytes:
                        return self._from_segment(conn, reply, source, offset, request_id)
                    buffer = self._buffers.take(tuple(reply.shape), layout.torch_dtype)
                    # The server is sending already: the same pieces, from the announced tag on (a layer-streamed
                    # send: as the prefill writes each layer, then the first token; layer_stream.py).
                    parts, trailer = receive_parts(receive_pieces(buffer, reply), reply)
                    if self.backend is TransferBackend.GLOO:  # posted here, waited for in a thread (pair.py)
                        finish = conn.pair.post_recv(parts, reply.tag).wait
                    else:
                        finish = functools.partial(conn.pair.recv, parts, reply.tag)
                    if posted is not None:  # the server ignored them (another layout): this pull's pair goes
                        self._forget_posted(address, conn, posted)
                posted = None
                await asyncio.get_running_loop().run_in_executor(self._executor, finish)
            except KvTransferError:
                self._forget_posted(address, conn, posted)  # closing the pair fails the server's send
                raise
            except Exception as e:  # gloo: timeout, peer gone (or its pair closed midway); the pair is dead
                self._forget_posted(address, conn, posted)
                raise _transfer_error(e, f"receiving {request_id!r} from {address}") from e
        self.stats.pulls += 1
        self.stats.bytes_received += buffer.numel() * buffer.element_size()
        if reply.posted:
            self.stats.posted_pulls += 1
        kv = received(reply, source, buffer)
        if trailer is not None:  # every layer and the first token arrived: decode may begin
            self.stats.streamed_pulls += 1
            return StreamedKv(
                kv.layout,
                kv.num_tokens,
                kv.blocks,
                first_block=kv.first_block,
                parts=kv.parts,
                first_token=int(trailer[0]),
            )
        return kv

    def _post(self, conn: _Connection, layout: KVLayout, num_tokens: int | None) -> PostedPull | None:
        """Post the receives of a pull of `num_tokens` tokens before its RPC, where the pair and layout allow."""
        posting = conn.posting
        if posting is None or not num_tokens or num_tokens < 1 or not can_post(layout):
            return None
        shape = posted_shape(layout, posting.block_size, num_tokens)
        cut = posted_cut(shape, layout.torch_dtype.itemsize)
        count = posted_pieces(shape, cut, layout.torch_dtype.itemsize, posting.chunk_bytes)
        if count > MAX_PIECES:
            return None
        buffer = self._buffers.take(shape, layout.torch_dtype)
        tag = conn.reserve_posted_tags(count)
        try:
            return PostedPull.post(conn.pair, buffer, tag, num_tokens, cut, posting.chunk_bytes)
        except RuntimeError:  # the pair closed under us (a failed transfer): the Pull will say ABORTED
            return None

    async def _check_posted(self, posted: PostedPull, reply: pb.PullReply, layout: KVLayout) -> KVLayout:
        """announced_layout of a reply that sends into our posted receives, which must announce exactly them.
        A reply that does not: PROTOCOL, once the send it started is over (the server checked the sizes, so
        it fills the receives; they are not dropped under bytes in flight)."""
        try:
            source = announced_layout(reply, layout)
            posted.check(reply)
            return source
        except KvTransferError:
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(self._executor, posted.transfer.wait)
            raise

    def _forget_posted(self, address: str, conn: _Connection, posted: PostedPull | None) -> None:
        """Forget the pair; receives still posted on it (`posted`, None: none) are given up at once (no wait,
        their buffer dropped, not reused: gloo still lists them, until the pair is gone: posted.py)."""
        if posted is not None:
            posted.abandon()
            self.stats.abandoned_posts += 1
        self._forget(address, conn)

    def _borrowed(self, conn: _Connection, reply: pb.PullReply, source: KVLayout, request_id: str) -> BorrowedKv:
        """The KV the server lent in place: its blocks of the mapped pool, released once imported (borrow.py)."""
        assert conn.local is not None
        pool, local, blocks = conn.pool, conn.local, list(reply.borrowed_blocks)
        loop = asyncio.get_running_loop()

        def release() -> None:  # from any thread (the import's, or the garbage collector's)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the connection went with it
                loop.call_soon_threadsafe(self._release, conn, request_id)

        if pool is None or pool.shape[3] != source.block_size or len(blocks) != reply.shape[2]:
            release()
            raise KvTransferError(FailureReason.PROTOCOL, f"{request_id!r} lent as blocks that are not its shape")
        if max(blocks) >= pool.shape[2]:
            release()
            raise KvTransferError(FailureReason.PROTOCOL, f"{request_id!r} lent as blocks outside the mapped pool")
        self.stats.pulls += 1
        self.stats.borrowed_pulls += 1
        metrics.KV_BORROWED_PULLS.labels(self.model_name, "decode").inc()
        kv = BorrowedKv(source, reply.num_tokens, pool, blocks, first_block=reply.first_block,
                        still_lent=local.alive, release=release)  # fmt: skip
        self.stats.bytes_received += kv.nbytes
        return kv

    def _release(self, conn: _Connection, request_id: str) -> None:
        """On the loop: send the release of a borrowed KV (kept until written: a task is only weakly held)."""
        task = asyncio.ensure_future(conn.pulls.release(request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _from_segment(
        self, conn: _Connection, reply: pb.PullReply, source: KVLayout, offset: int, request_id: str
    ) -> KVExport:
        """The KV the server wrote into our segment: a view of it, whose region is freed with the tensor."""
        assert conn.segment is not None and conn.regions is not None
        regions, used = conn.regions, -(-reply.shm_bytes // 64) * 64
        expected = math.prod(reply.shape) * source.torch_dtype.itemsize
        try:
            if reply.shm_bytes != expected:
                raise ValueError(f"{reply.shm_bytes} bytes written for {list(reply.shape)}")
            blocks = conn.segment.view(
                offset, tuple(reply.shape), source.torch_dtype, lambda: regions.free(offset, used)
            )
        except ValueError as e:
            regions.free(offset, used)
            raise KvTransferError(FailureReason.PROTOCOL, f"{request_id!r} in shared memory: {e}") from e
        self.stats.pulls += 1
        self.stats.shm_pulls += 1
        self.stats.bytes_received += reply.shm_bytes
        return received(reply, source, blocks)

    async def _call(self, address: str, conn: _Connection | None, call, what: str):
        """Await an RPC on `conn`'s pair (None: Connect), mapping its failure to KvTransferError."""
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            if conn is not None and e.code() not in REFUSALS:
                # The server may have started a send we will never receive; its failure would close the
                # pair under our next transfer. ABORTED: the server does not know the pair at all.
                self._forget(address, conn)
            if conn is not None and e.code() is grpc.StatusCode.ABORTED:
                raise _StalePair(FailureReason.UNAVAILABLE, f"{what} to {address}: {e.details()}") from e
            raise KvTransferError.from_rpc(e, f"{what} to {address}") from e

    async def _connection(self, address: str, layout: KVLayout) -> _Connection:
        """The pair with `address`, negotiated on first use; concurrent first pulls share one negotiation."""
        task = self._connections.get(address)
        if task is None:
            task = asyncio.ensure_future(self._connect(address, layout))
            self._connections[address] = task
        try:
            return await asyncio.shield(task)
        except BaseException:
            if task.done() and self._connections.get(address) is task:
                del self._connections[address]  # a failed negotiation is not cached
            raise

    async def _connect(self, address: str, layout: KVLayout) -> _Connection:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._channel(address)
        stub = pb_grpc.KvTransferStub(channel)
        request = pb.ConnectRequest(
            decode_worker_id=self.worker_id,
            backend=self.backend.wire,
            layout_fingerprint=layout.fingerprint,
            ticket=self._tickets.mint(self.worker_id),
            host_id=self.host_id,
        )
        reply = await self._call(address, None, stub.Connect(request, timeout=self.timeout_s), "Connect")
        segment = self._attach(reply) if reply.shm_name and self.host_id else None
        try:
            pair = await asyncio.get_running_loop().run_in_executor(self._executor, self._join, reply)
        except Exception as e:
            raise _transfer_error(e, f"joining pair {reply.pair_id!r} at {reply.store_host}:{reply.store_port}") from e
        self.stats.connects += 1
        order = contextlib.nullcontext() if self.backend.tagged else asyncio.Lock()
        regions = None if segment is None else Regions(segment.nbytes)
        posting = reply if reply.posted_pulls and self.backend is TransferBackend.GLOO and reply.block_size else None
        local = await self._local_call(reply) if segment is not None else None
        pulls = PullStream(stub.PullStream if local is None else lambda: local)  # pyright: ignore[reportArgumentType]
        pool = self._map_pool(reply, layout) if local is not None else None
        conn = _Connection(stub, pair, pulls, order, segment, regions, posting, local=local, pool=pool)
        pulls.on_break = functools.partial(self._forget, address, conn)  # the server stopped or died: unmap now
        return conn

    def _map_pool(self, reply: pb.ConnectReply, layout: KVLayout) -> torch.Tensor | None:
        """The prefill pool the server offered, mapped read-only; None (pulls through the segment) when it offered
        none, borrowing is off, or it cannot be mapped from here (logged)."""
        if not (self.borrow and reply.HasField("pool") and reply.block_size):
            return None
        source = dataclasses.replace(layout, block_size=reply.block_size, kv_heads=())
        try:
            handle = pool_handle(reply.pool)
            return attach_pool(handle, source.block_shape(handle.num_blocks), source.torch_dtype)
        except (OSError, ValueError) as e:  # another pid namespace or user, the process gone, not that pool
            log.warning("could not map the prefill worker's KV pool (%s): pulls go through the segment", e)
            return None

    async def _local_call(self, reply: pb.ConnectReply) -> LocalCall | None:
        """The server's Unix socket for this pair's pulls, if it offered one and we reach it; None: gRPC."""
        if not (reply.local_stream and self.local_stream):
            return None
        try:
            return await LocalCall.connect(reply.local_stream, MAX_MESSAGE_BYTES, self.timeout_s)
        except (OSError, TimeoutError) as e:  # e.g. another network namespace: the abstract name is not here
            log.info("the prefill worker's local pull stream is not reachable (%s): pulls go over gRPC", e)
            return None

    def _attach(self, reply: pb.ConnectReply) -> Segment | None:
        """Map (and unlink) the segment the server offered; None, the socket path, if that fails."""
        try:
            return Segment.attach(reply.shm_name, reply.shm_bytes)
        except (OSError, ValueError) as e:
            log.warning("could not map the shared KV segment %r (%s): pulls go over the socket", reply.shm_name, e)
            return None

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=self.tls.channel_options())

    def _join(self, reply: pb.ConnectReply) -> Pair:
        """Blocking: reach the prefill worker's store, build our rank of the pair's group, exchange proofs."""
        store = store_client(reply.store_host, reply.store_port, self.timeout_s)
        local = local_address_towards(reply.store_host) if self.backend is TransferBackend.GLOO else None
        pair = Pair.join(self.backend, store, reply.pair_id, DECODE_RANK, self.timeout_s, local)
        self._proofs.confirm(pair)  # PairRefused (pair closed): the rank 0 we reached is not the prefill worker
        return pair

    def _forget(self, address: str, conn: _Connection) -> None:
        """Stop using `conn`'s pair: the next pull from `address` negotiates a new one. Closing our side
        (once no recv is in flight on it) closes the connection, which fails the server's pending sends. Pulls
        still waiting on its stream get their answers (and then find the pair closed, or finish)."""
        conn.pulls.on_break = None  # called once at most (and no cycle left through it)
        conn.pulls.close_when_idle()
        conn.pair.close()
        if conn.segment is not None:  # unmapped now unless a pulled tensor still lives on it
            conn.segment.close()
        conn.pool = None  # the prefill pool, unmapped once no borrowed KV still reads it
        task = self._connections.get(address)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            if task.result() is conn:
                del self._connections[address]


def _transfer_error(error: Exception, what: str) -> KvTransferError:
    timed_out = "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower()
    reason = FailureReason.TIMEOUT if timed_out else FailureReason.UNAVAILABLE
    return KvTransferError(reason, f"{what}: {error}")
