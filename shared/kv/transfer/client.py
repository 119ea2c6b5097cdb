"""Decode side of the KV transfer plane: pull a request's KV from the prefill worker that holds it.

The first pull from an address negotiates a pair (Connect RPC, then both sides join a two-rank group); later pulls
reuse it. Connect's reply says which transports the server offers this pair (transports/: the borrowed pool, the
shared segment, posted receives, the pair's sends); the pair keeps a receiver of each it can take. A pull is one
Pull (a message on the pair's PullStream, pull_stream.py, or on the server's Unix socket on one host,
local_stream.py): each receiver may add its offer to it first (a region, posted receives, a wish to borrow); the
server answers with one transport's reply, and the first receiver that recognises it receives the KV into the
caller's buffers (new memory, or memory a caller handed back with `recycle`). Each call carries a ticket this
client mints with the cluster secret for its own worker id (shared/kv/tickets.py), a fresh one per call (the
server accepts each ticket once: a retry mints anew). With `tls` the channel is TLS, presenting this worker's
certificate (channel_tls.py). A joined pair is used only once the prefill side proved it holds the cluster secret
(pair_proof.py). Blocking joins and recv waits run in this client's thread pool, so the decode loop keeps stepping
while KV arrives. Every failure surfaces as KvTransferError; one that may have left the pair mid-transfer closes
and forgets it, so the next pull negotiates a fresh pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from shared.engine.borrowed_kv import BorrowedKv
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.tickets import Tickets
from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.client_pair import REFUSALS, ClientPair, join_pair, open_channel, open_local, transfer_error
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.heads import head_fields
from shared.kv.transfer.pair import TransferBackend, check_backend
from shared.kv.transfer.pair_proof import PairProofs
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.shm import host_identity
from shared.kv.transfer.transports.base import Arrival, Offer, Pull, Transport
from shared.kv.transfer.transports.receives import ClientStats, Link, Receives
from shared.kv.transfer.transports.registry import TRANSPORTS, with_fallback
from shared.kv.transfer.transports.segment import SegmentReceiver
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc
from shared.telemetry import metrics, tracing

__all__ = ["ClientStats", "KvTransferClient"]
MAX_BLOCKING_THREADS = 32  # joins + recv waits at once; more queue for a free thread


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
        transports: Sequence[Transport] = TRANSPORTS,
    ) -> None:
        """secret: the cluster secret (at least 16 bytes) this client signs its tickets with. timeout_s
        bounds each RPC, forming a pair, and each transfer's receive. tls: TLS with this worker's certificate
        (None: plaintext gRPC). group_id: the decode group whose pull tickets this rank's pulls carry
        (shared/kv/rank_transfer.py); None: worker_id's own. shared_memory: take a shared segment from a
        prefill worker on this host (False: every pull over the pair). local_stream: send a same-host pair's
        pulls over the server's Unix socket when it offers one (False: the PullStream RPC; for comparison). borrow:
        map a same-host prefill worker's pool when it offers it, and borrow a request's blocks in place (the
        result is a BorrowedKv: the import copies from that pool; release it once imported, `recycle` does);
        False: through the segment. transports: those this client takes when offered, in order
        (transports/registry.py; the plain pair receive is always last)."""
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
        self._receives = Receives(self.backend, model_name, self.stats, self._buffers, self._executor, borrow)
        self._transports = with_fallback(transports)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._connections: dict[str, asyncio.Task[ClientPair]] = {}

    async def pull(
        self,
        address: str,
        request_id: str,
        layout: KVLayout,
        group_pulls: int = 0,
        num_tokens: int | None = None,
        skip_tokens: int = 0,
    ) -> KVExport:
        """Fetch the KV of `request_id` from the prefill worker at `address`; `layout` is the receiving
        engine's (block size may differ: the result carries the source's, `reblock` re-cuts); a layout naming
        `kv_heads` pulls only those (contiguous) heads from a group rank, one of `group_pulls`. The prefill
        side frees its blocks once the bytes are out. num_tokens: how many tokens the KV covers, when known (the
        KV location's count): the receives are then posted before the Pull (posted.py); a wrong count only
        costs the pair (the server ignores such receives, the KV arrives as without). skip_tokens: a partial pull
        (skip.py): this side holds the first skip_tokens tokens, send from their last block on (the result's
        first_block says where it starts; earlier where the source sends whole); nothing is posted ahead then.
        Raises KvTransferError (see its `reason`).
        Traced as a `pull_kv` span (child of the current one) whose context travels in the gRPC metadata."""
        labels = (self.model_name, "decode")
        started = time.perf_counter()
        attributes = {tracing.REQUEST_ID: request_id, tracing.KV_PEER: address}
        with tracing.tracer.start_as_current_span(
            f"{tracing.PULL_KV} {self.model_name}", kind=tracing.trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            try:
                try:
                    kv = await self._pull_once(address, request_id, layout, group_pulls, num_tokens, skip_tokens)
                except _StalePair:  # a new pair, once; a second stale answer propagates as UNAVAILABLE
                    kv = await self._pull_once(address, request_id, layout, group_pulls, num_tokens, skip_tokens)
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
        segment = task.result().receiver(SegmentReceiver.name)
        return segment.regions.free_bytes if isinstance(segment, SegmentReceiver) else None

    async def close(self) -> None:
        """Drop every pair and channel. Pulls still in flight fail."""
        for task in self._connections.values():
            task.cancel()
            if task.done() and not task.cancelled() and task.exception() is None:
                conn = task.result()
                conn.pulls.close()
                conn.pair.close()
                for receiver in conn.receivers:
                    receiver.close()
        self._connections.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _pull_once(
        self,
        address: str,
        request_id: str,
        layout: KVLayout,
        group_pulls: int,
        num_tokens: int | None,
        skip_tokens: int = 0,
    ) -> KVExport:
        conn = await self._connection(address, layout)
        request = pb.PullRequest(
            request_id=request_id,
            ticket=self._tickets.mint(self.group_id, request_id),
            decode_worker_id=self.worker_id,
            pair_id=conn.pair.pair_id,
            layout_fingerprint=layout.fingerprint,
            skip_tokens=skip_tokens,
            **head_fields(layout, group_pulls),
        )
        pull = Pull(request, layout, None if skip_tokens else num_tokens)  # posted receives are cut for all of it
        async with conn.order:
            offers: dict[str, Offer] = {}  # by receiver: what each set up for this pull
            for receiver in conn.receivers:
                if (offer := receiver.prepare(conn.link, pull)) is not None:
                    offers[receiver.name] = offer
            call = conn.pulls.pull(request, tracing.grpc_metadata(), self.timeout_s)
            try:
                reply = await self._call(address, conn, call, "Pull")
            except BaseException as e:
                if self._withdraw(offers.values()):  # receives still posted: nothing will fill them
                    self._forget(address, conn)
                elif isinstance(e, asyncio.CancelledError):
                    # The server handles the message all the same and may start a send nobody receives:
                    # closing the pair fails that send at once (and frees its KV) instead of at its timeout.
                    self._forget(address, conn)
                raise
            if conn.link.local:
                self.stats.local_pulls += 1
                metrics.KV_LOCAL_PULLS.labels(self.model_name, "decode").inc()
            for offer in offers.values():
                offer.answered(reply)
            try:
                name, arrival = await self._receive(conn, pull, reply, offers)
                # Offers the answer did not use go (posted receives: with the pair, once this receive is posted)
                if self._withdraw(o for n, o in offers.items() if n != name):
                    self._forget(address, conn)
                offers.clear()
                if arrival.wait is not None:
                    await asyncio.get_running_loop().run_in_executor(self._executor, arrival.wait)
            except KvTransferError:
                self._withdraw(offers.values())
                self._forget(address, conn)  # closing the pair fails the server's send
                raise
            except Exception as e:  # gloo: timeout, peer gone (or its pair closed midway); the pair is dead
                self._withdraw(offers.values())
                self._forget(address, conn)
                raise transfer_error(e, f"receiving {request_id!r} from {address}") from e
        kv = arrival.result()
        self.stats.by_transport[name] += 1
        metrics.KV_PULLS.labels(self.model_name, "decode", name).inc()
        return kv

    async def _receive(
        self, conn: ClientPair, pull: Pull, reply: pb.PullReply, offers: dict[str, Offer]
    ) -> tuple[str, Arrival]:
        """The first of the pair's receivers that recognises the reply receives it (the plain pair's is last)."""
        for receiver in conn.receivers:
            arrival = await receiver.receive(conn.link, pull, reply, offers.get(receiver.name))
            if arrival is not None:
                return receiver.name, arrival
        raise KvTransferError(FailureReason.PROTOCOL, "a reply no transport of this pair receives")

    @staticmethod
    def _withdraw(offers) -> bool:
        """Withdraw every offer; True when one leaves receives posted on the pair (it must go)."""
        return any([offer.withdraw() for offer in offers])

    async def _call(self, address: str, conn: ClientPair | None, call, what: str):
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

    async def _connection(self, address: str, layout: KVLayout) -> ClientPair:
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

    async def _connect(self, address: str, layout: KVLayout) -> ClientPair:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self.tls)
        stub = pb_grpc.KvTransferStub(channel)
        request = pb.ConnectRequest(
            decode_worker_id=self.worker_id,
            backend=self.backend.wire,
            layout_fingerprint=layout.fingerprint,
            ticket=self._tickets.mint(self.worker_id),
            host_id=self.host_id,
        )
        reply = await self._call(address, None, stub.Connect(request, timeout=self.timeout_s), "Connect")
        # Each transport the server offered takes it up now, before the pair forms (a segment's name goes then)
        receivers = [r for t in self._transports if (r := t.connect(self._receives, reply, layout)) is not None]
        try:
            join = functools.partial(join_pair, reply, self.backend, self.timeout_s, self._proofs)
            pair = await asyncio.get_running_loop().run_in_executor(self._executor, join)
        except Exception as e:
            for receiver in receivers:
                receiver.close()
            raise transfer_error(e, f"joining pair {reply.pair_id!r} at {reply.store_host}:{reply.store_port}") from e
        self.stats.connects += 1
        order = contextlib.nullcontext() if self.backend.tagged else asyncio.Lock()
        wanted = self.local_stream and bool(self.host_id)  # same host asked for, and the socket not turned off
        local = await open_local(reply, wanted, self.timeout_s)
        pulls = PullStream(stub.PullStream if local is None else lambda: local)  # pyright: ignore[reportArgumentType]
        conn = ClientPair(stub, Link(pair, pulls, local), order, receivers)
        pulls.on_break = functools.partial(self._forget, address, conn)  # the server stopped or died: unmap now
        return conn

    def _forget(self, address: str, conn: ClientPair) -> None:
        """Stop using `conn`'s pair: the next pull from `address` negotiates a new one. Closing our side
        (once no recv is in flight on it) closes the connection, which fails the server's pending sends. Pulls
        still waiting on its stream get their answers (and then find the pair closed, or finish)."""
        conn.pulls.on_break = None  # called once at most (and no cycle left through it)
        conn.pulls.close_when_idle()
        conn.pair.close()
        for receiver in conn.receivers:  # a segment, a mapped pool: let go once no pulled tensor uses them
            receiver.close()
        task = self._connections.get(address)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            if task.result() is conn:
                del self._connections[address]
