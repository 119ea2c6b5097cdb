"""Prefill side of the KV transfer plane: the gRPC `KvTransfer` service and the sends it starts.

One TCPStore per server is the rendezvous of all its pairs (one per decode worker, each under its own key
prefix). Threading: gRPC handlers run on the event loop; pair construction and send waits, which block,
run in this server's thread pool, so the loop (and the engine steps it drives) keeps going. Sends that cost
nothing to produce are posted from the loop before the reply (loop_send.py); only their wait takes a thread.
A Pull whose receives the puller posted already (posted.py) is sent into them, under the puller's tags.
Clients send their pulls as messages of one PullStream per pair (pull_stream.py); each goes through `pull`, as a
unary Pull does, and gets its own answer. `stop` ends the open streams (UNAVAILABLE) before it waits for calls.

Every call is checked before it touches anything: readable message, ids present and of sane length,
then a ticket signed with the cluster secret for this caller (and, on Pull, this request), used for the
first time (replay.py: each ticket is single-use). With `tls` the gRPC port speaks only TLS and requires a
client certificate signed by the deployment's CA (channel_tls.py). A pair is used only after its peer proved
it holds the cluster secret (pair_proof.py); its id is unguessable, yet not secret from the store. A refused call
changes nothing (the KV stays held), is logged with its reason (never the ticket) and counted in
`pdserve:kv_transfer_failures_total`. Sends go out in pieces of at most `chunk_bytes`, straight from the
pool's blocks where the source lends them (pool_kv.py); a decode worker on this host (same host identity)
gets a shared-memory segment with its pair, and a pull whose KV fits the region it offers is written there
instead (shm.py). `fault_send_midway` (tests only) stops each send after its first piece (or half the
bytes, in shared memory) and drops the pair; `fault_send_stall_s` (tests only) sleeps there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import grpc
import torch.distributed as dist

from shared.engine.shared_pool import PoolHandle
from shared.kv.replay import DEFAULT_CAPACITY, ReplayCache
from shared.kv.tickets import TicketError, TicketReason, Tickets
from shared.kv.transfer import pull_stream
from shared.kv.transfer.borrow import Lender, pool_memory
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.heads import HeadsRefused, begin_send
from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.local_stream import LocalListener
from shared.kv.transfer.loop_send import loop_pieces
from shared.kv.transfer.pair import PREFILL_RANK, Pair, TransferBackend, check_backend, store_client
from shared.kv.transfer.pair_proof import PairProofs, PairRefused
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.posted import posted_kv
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES, Call, Unreadable, handler, short
from shared.kv.transfer.segment_send import InjectedFault, copy_into_region, fits, shape_of
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.shm import Segment, host_identity, sweep_stale
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.source import AlreadySending, KvSource, Outgoing
from shared.kv.transfer.wire import announce, describe, num_pieces, pieces
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics, tracing

# torch.distributed re-exports its C++ stores (Store, TCPStore, PrefixStore) without marking them public.
# pyright: reportPrivateImportUsage=false

log = logging.getLogger(__name__)
MAX_BLOCKING_THREADS = 32  # joins + sends waiting at once; more queue for a free thread
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
DEFAULT_CHUNK_BYTES = 64 << 20  # KV of up to this size moves in one piece
MIN_CHUNK_BYTES = 1024
MAX_ID_CHARS = 512  # request, worker and pair ids; longer is refused as INVALID_ARGUMENT
SERVICE = pb.DESCRIPTOR.services_by_name["KvTransfer"].full_name
# A refused ticket: no usable credential at all → UNAUTHENTICATED; a real one that does not grant this call
# (or a signature that does not check out) → PERMISSION_DENIED.
_TICKET_CODES = {
    TicketReason.MISSING: grpc.StatusCode.UNAUTHENTICATED,
    TicketReason.MALFORMED: grpc.StatusCode.UNAUTHENTICATED,
    TicketReason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a valid ticket, no room to remember it
}
PAIR_ID_BYTES = 24  # of CSPRNG output in each pair id
DEFAULT_SHM_BYTES = 256 << 20  # a same-host pair's segment: KV up to this size skips the socket
# A shared-memory send of up to this size is copied on the loop (~5 ms at 13 GB/s; torch releases the GIL, the
# engine thread runs on): the hops to a send thread and back cost ~0.9 ms of a 4k-token pull's 6.7 (AMD EPYC).
SHM_COPY_ON_LOOP_BYTES = 64 << 20


@dataclass
class ServerStats:
    pairs_created: int = 0  # Connect calls accepted: one process group each
    pulls: int = 0  # pulls accepted (export done, send started)
    shm_pulls: int = 0  # of which written into a pair's shared segment
    borrowed_pulls: int = 0  # of which lent in place: the puller copied the blocks from the shared pool
    streamed_pulls: int = 0  # of which sent layer by layer as the prefill wrote them (layer_stream.py)
    posted_pulls: int = 0  # of which sent into receives the puller posted before its Pull (posted.py)
    segments: int = 0  # shared segments created (one per same-host pair)
    bytes_sent: int = 0
    failed_sends: int = 0  # injected faults included
    refused: int = 0  # calls refused for their ticket or as malformed


class KvTransferServer:
    """Serves pulls of the KV that `source` holds. `start()` binds; `stop()` waits for sends in flight."""

    def __init__(
        self,
        host: str,
        port: int,
        source: KvSource,
        *,
        secret: bytes | str,
        backend: TransferBackend | str = "gloo",
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        fault_send_midway: bool = False,
        advertise_host: str | None = None,
        model_name: str = "",
        send_stream: SendStream | None = None,
        tls: KvTls | None = None,
        replay_capacity: int = DEFAULT_CAPACITY,
        ticket_holder: Callable[[str], str] | None = None,
        shm_bytes: int = DEFAULT_SHM_BYTES,
        fault_send_stall_s: float = 0.0,
        shared_pool: PoolHandle | None = None,
    ) -> None:
        """host/port: where gRPC binds (port 0: any free one). secret: the cluster secret tickets are
        signed with (at least 16 bytes). advertise_host: the name decode workers dial for gRPC, the store
        and gloo (default: host, or this machine's FQDN when host is a wildcard). timeout_s bounds a pair's
        forming and each send; a send that times out frees the KV all the same. chunk_bytes: the largest
        piece a send moves (0 = one piece). fault_send_midway: testing only, every send fails after its first
        piece (see `_send`). model_name labels this server's spans and metrics. send_stream: the stream sends
        run on, shared with the source's exports (send_stream.py; None: no stream, as on CPU). tls: serve gRPC
        over TLS with client certificates (None: plaintext). replay_capacity: the most unexpired tickets
        remembered against replay. ticket_holder: the id a caller's pull ticket must name (a group rank's: its
        group's, shared/kv/rank_transfer.py); None: the caller's own. shm_bytes: the size of the shared
        segment a same-host pair gets (0: no shared memory, every pull over the pair). fault_send_stall_s:
        testing only, every send sleeps this long midway (after its first piece, or half its bytes in shared
        memory), so that a test can kill this process mid-transfer. shared_pool: the source's pool in a memfd
        (shared/engine/shared_pool.py): a same-host pair whose pulls go over the Unix socket maps it, and borrows
        a request's blocks in place instead of a copy (borrow.py)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if chunk_bytes != 0 and chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 0 (one piece) or at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
        self.host = host
        self.port = port
        self.source = source
        self.backend = check_backend(backend)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.fault_send_midway = fault_send_midway
        self.fault_send_stall_s = fault_send_stall_s
        self.shm_bytes = shm_bytes
        self.host_id = host_identity() if shm_bytes else ""
        self.shared_pool = shared_pool if self.host_id else None
        self.model_name = model_name
        self.send_stream = send_stream or SendStream("cpu")
        self._tickets = Tickets(secret)
        self._replays = ReplayCache(replay_capacity, self._tickets.skew_s)
        self._proofs = PairProofs(secret)
        self.tls = tls
        self._ticket_holder = ticket_holder or (lambda worker: worker)
        self.stats = ServerStats()
        # Where decode workers reach this machine, for the store and for gloo's listening socket.
        self.public_host = advertise_host or (socket.getfqdn() if host in WILDCARD_HOSTS else host)
        self._executor = ThreadPoolExecutor(MAX_BLOCKING_THREADS, thread_name_prefix="kv-send")
        self._pairs: dict[str, Slot] = {}  # by decode worker id
        self._issued: set[str] = set()  # every pair id handed out: one Connect's worth of bytes each
        self._sends: set[asyncio.Task[None]] = set()
        self._streams: set[grpc.aio.ServicerContext] = set()  # of the PullStream calls open (one per pair)
        # Same host: the Unix socket pairs with a segment send their pulls to (local_stream.py)
        self._local = LocalListener(self.pull, MAX_MESSAGE_BYTES, timeout_s) if self.host_id else None
        self._store: dist.TCPStore | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Host the rendezvous store and start serving; returns the "host:port" decode workers dial."""
        if self.host_id:
            for name in sweep_stale():
                log.info("removed the shared KV segment %s of a process that is gone", name)
        if self._local is not None:
            await self._local.start()
        self._store = dist.TCPStore(
            self.public_host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s)
        )
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        handlers = {
            "Connect": handler(self.connect, pb.ConnectRequest, pb.ConnectReply),
            "Pull": handler(self.pull, pb.PullRequest, pb.PullReply),
            "PullStream": handler(self.pull_stream, pb.PullStreamRequest, pb.PullStreamReply, streaming=True),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        # typeshed's grpcio stubs lack this (grpcio >= 1.62 has it on grpc.aio.Server)
        self._server.add_registered_method_handlers(SERVICE, handlers)  # pyright: ignore[reportAttributeAccessIssue]
        if self.fault_send_midway:
            log.warning("KV transfer fault injection is on: every send stops after its first piece")
        bind = f"{self.host}:{self.port}"
        if self.tls is None:
            self.port = self._server.add_insecure_port(bind)
        else:
            self.port = self._server.add_secure_port(bind, self.tls.server_credentials())
        await self._server.start()
        return f"{self.public_host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; wait for the sends in flight (each ends within timeout_s) and their releases."""
        for stream in list(self._streams):  # a client keeps its stream open: it would last the whole grace
            with contextlib.suppress(Exception):
                await stream.abort(grpc.StatusCode.UNAVAILABLE, "the KV transfer server is stopping")
        if self._local is not None:
            await self._local.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
        for slot in self._pairs.values():
            slot.retire()
        self._pairs.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._server = self._store = None

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    async def connect(
        self, request: pb.ConnectRequest | Unreadable, context: grpc.aio.ServicerContext
    ) -> pb.ConnectReply:
        request = await self._check_shape(context, "Connect", request, "decode_worker_id")
        worker = request.decode_worker_id
        await self._authorize(context, "Connect", request.ticket, worker)
        backend = TransferBackend.from_wire(request.backend)
        if backend is None:
            await self._refuse(context, "Connect", worker, f"unknown transfer backend {request.backend}")
        if backend is not self.backend:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this server transfers over {self.backend}")
        await self._check_fingerprint(request.layout_fingerprint, context)
        store = self._store
        assert store is not None  # start() sets it before the server takes calls; stop() unsets it after
        # Unguessable, but readable by any client of the store (list_keys): the pair proof is what keeps
        # strangers out. A reused id would meet the old pair's keys in the store.
        pair_id = f"{worker}/{secrets.token_urlsafe(PAIR_ID_BYTES)}"
        if pair_id in self._issued:
            await context.abort(grpc.StatusCode.INTERNAL, "a pair id came up twice; connect again")
        self._issued.add(pair_id)
        joining = asyncio.get_running_loop().run_in_executor(self._executor, self._join, pair_id, store.port)
        # A reconnecting worker replaces its old pair: transfers still on it finish or fail on their own.
        old = self._pairs.get(worker)
        self._pairs[worker] = slot = Slot(worker, pair_id, joining)
        if old is not None:
            old.retire()
        joining.add_done_callback(lambda f: self._on_joined(slot, f))
        self.stats.pairs_created += 1
        reply = pb.ConnectReply(store_host=self.public_host, store_port=store.port, pair_id=pair_id)
        if self.backend is TransferBackend.GLOO:  # NCCL matches in issue order: its client posts after the reply
            reply.posted_pulls, reply.chunk_bytes = True, self.chunk_bytes
            reply.block_size = self.source.layout.block_size
        if self.host_id and request.host_id == self.host_id:
            slot.segment = await self._create_segment(worker)
            if slot.segment is not None:
                reply.shm_name, reply.shm_bytes = slot.segment.name, slot.segment.nbytes
                if self._local is not None:
                    reply.local_stream = self._local.name
                    if self.shared_pool is not None:  # lent only over the socket (its release, its end)
                        reply.pool.CopyFrom(pool_memory(self.shared_pool))
                if joining.done():  # the pair failed already: its callback found no segment to unlink
                    slot.segment.unlink()
        return reply

    async def _create_segment(self, worker: str) -> Segment | None:
        """The shared segment of a same-host pair; None (logged) when /dev/shm cannot hold it."""
        try:
            segment = await asyncio.get_running_loop().run_in_executor(self._executor, Segment.create, self.shm_bytes)
        except OSError as e:
            log.warning("no shared KV segment for %s (%s): its pulls go over the socket", short(worker), e)
            return None
        self.stats.segments += 1
        return segment

    async def pull(self, request: pb.PullRequest | Unreadable, context: grpc.aio.ServicerContext) -> pb.PullReply:
        """Accept a pull: check, export, announce, start the send. The `send_kv` span (child of the puller's
        span, from the gRPC metadata) covers export and send; the send task ends it."""
        request = await self._check_shape(context, "Pull", request, "request_id", "decode_worker_id", "pair_id")
        # trace context travels in text entries; binary ("-bin") entries come as bytes and carry none
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        span = tracing.start_span(
            f"{tracing.SEND_KV} {self.model_name}",
            tracing.extract(metadata),
            kind=tracing.trace.SpanKind.SERVER,
            attributes={tracing.REQUEST_ID: request.request_id, tracing.KV_PEER: request.decode_worker_id},
        )
        try:
            return await self._accept(request, context, span)
        except BaseException as e:  # refused (context.abort raises) or failed before any send
            tracing.end_span(span, error=f"{type(e).__name__}: {e}")
            raise

    async def pull_stream(self, requests, context: grpc.aio.ServicerContext) -> None:
        """Pulls as messages of one long-lived stream per pair (pull_stream.py), each handled as `pull`."""
        self._streams.add(context)
        try:
            await pull_stream.serve(self.pull, requests, context.write, context.peer())
        except pull_stream.MessageAborted as e:
            await context.abort(e.code, e.details)
        finally:
            self._streams.discard(context)

    async def _accept(self, request: pb.PullRequest, context: grpc.aio.ServicerContext, span) -> pb.PullReply:
        started = time.perf_counter()
        rid, worker = request.request_id, request.decode_worker_id
        await self._authorize(context, "Pull", request.ticket, self._ticket_holder(worker), rid)
        slot = self._pairs.get(worker)
        if slot is None or slot.pair_id != request.pair_id:
            await context.abort(grpc.StatusCode.ABORTED, f"pair {request.pair_id!r} is not open here; connect again")
        await self._check_fingerprint(request.layout_fingerprint, context)
        if self.source.is_sending(rid):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already being pulled")
        try:
            pair = await self._joined(slot)
        except Exception as e:  # the join failed or hangs: this pair is no good
            self._drop(slot)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pair {slot.pair_id!r} did not form: {e!r}")
        try:  # from here until the send task's end_send, the source counts the request as sending
            kv = await begin_send(self.source, rid, request)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else repr(e))
        except AlreadySending as e:  # a second pull got past the check above during the join
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except HeadsRefused as e:  # heads this source does not hold, or one that serves whole KV only
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span.set_attributes(
            {
                tracing.KV_EXPORT_TIME: time.perf_counter() - started,
                tracing.KV_BYTES: kv.nbytes,
                tracing.KV_TOKENS: kv.num_tokens,
            }
        )
        self.stats.pulls += 1
        streamed = isinstance(kv, StreamedPoolKv)  # layer by layer, then the first token (layer_stream.py)
        lender = getattr(context, "lender", None)  # a message of a same-host pair's Unix socket
        if request.borrow and lender is not None and not lender.revoked and rid not in lender and self._lendable(kv):
            assert isinstance(kv, PoolKv)
            return self._lend(lender, kv, request, span, started)
        if not streamed and fits(slot.segment, request.shm_offset, request.shm_capacity, kv):
            return await self._write_segment(slot, kv, request, span, started, context)
        into = posted_kv(kv, request.posted, self.chunk_bytes) if request.HasField("posted") else None
        if into is not None:  # the puller's receives are posted already: send into them now (posted.py)
            kv, tag = into, request.posted.tag
            reply = announce(kv.layout, kv.num_tokens, kv.shape, tag, self.chunk_bytes, kv.runs)
            reply.posted = True
            self.stats.posted_pulls += 1
            metrics.KV_POSTED_PULLS.labels(self.model_name, "prefill").inc()
        elif isinstance(kv, PoolKv):
            tag = slot.reserve_tags(kv.num_pieces(self.chunk_bytes))
            reply = announce(kv.layout, kv.num_tokens, kv.shape, tag, self.chunk_bytes, kv.runs, kv.first_block)
            if isinstance(kv, StreamedPoolKv):
                kv.wait_s, reply.layer_streamed = self.timeout_s, True
                self.stats.streamed_pulls += 1
                metrics.KV_LAYER_STREAMED.labels(self.model_name, "prefill").inc()
        else:
            tag = slot.reserve_tags(num_pieces(kv.blocks.numel(), kv.blocks.element_size(), self.chunk_bytes))
            reply = describe(kv, tag, self.chunk_bytes)
        task = asyncio.create_task(self._send(slot, kv, self._post_now(pair, kv, tag), rid, span, started))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return reply

    def _lendable(self, kv: Outgoing) -> bool:
        """The KV can be lent in place: a whole request's blocks in the shared pool, complete (not a layer stream),
        and no test fault to inject (those act on copies)."""
        faults = self.fault_send_midway or self.fault_send_stall_s
        if not isinstance(kv, PoolKv) or isinstance(kv, StreamedPoolKv):
            return False
        return self.shared_pool is not None and kv.pool.memory is not None and not faults

    def _lend(self, lender: Lender, kv: PoolKv, request: pb.PullRequest, span, started: float) -> pb.PullReply:
        """Answer with the request's block ids: the puller copies them from the mapped pool (borrow.py). The send
        stays open, the blocks held, until the release message, or until the connection ended (revoked)."""
        rid, labels = request.request_id, (self.model_name, "prefill")

        async def end(released: bool) -> None:
            error = None
            if released:
                self.stats.bytes_sent += kv.nbytes
                metrics.KV_TRANSFER_BYTES.labels(*labels).inc(kv.nbytes)
                metrics.KV_TRANSFER_SECONDS.labels(*labels).observe(time.perf_counter() - started)
            else:
                self.stats.failed_sends += 1
                metrics.KV_TRANSFER_FAILURES.labels(*labels, "loan_revoked").inc()
                error = "the connection ended before the borrowed blocks were released"
            await self._end_send(rid, error, span, started)

        lender.lend(rid, end)
        self.stats.borrowed_pulls += 1
        reply = announce(kv.layout, kv.num_tokens, shape_of(kv), 0, 0, first_block=kv.first_block)
        reply.borrowed_blocks.extend(kv.block_ids)
        return reply

    async def _write_segment(
        self, slot: Slot, kv: Outgoing, request: pb.PullRequest, span, started: float, context
    ) -> pb.PullReply:
        """The shared-memory send: one gather of the blocks into the region the puller offered, then the reply
        says it is there. The KV is freed either way, as after a send over the pair."""
        assert slot.segment is not None
        rid, labels, error = request.request_id, (self.model_name, "prefill"), None
        shape = shape_of(kv)
        faults = (self.fault_send_midway, self.fault_send_stall_s)
        try:
            region = slot.segment.view(request.shm_offset, shape, kv.layout.torch_dtype)
            if kv.nbytes <= SHM_COPY_ON_LOOP_BYTES and not any(faults):
                copy_into_region(kv, region)  # the loop waits a few ms; a send thread costs two hops more
            else:
                await asyncio.get_running_loop().run_in_executor(self._executor, copy_into_region, kv, region, *faults)
            self.stats.shm_pulls += 1
            self.stats.bytes_sent += kv.nbytes
            metrics.KV_TRANSFER_BYTES.labels(*labels).inc(kv.nbytes)
            metrics.KV_TRANSFER_SECONDS.labels(*labels).observe(time.perf_counter() - started)
        except Exception as e:
            self.stats.failed_sends += 1
            metrics.KV_TRANSFER_FAILURES.labels(*labels, _failure_reason(e)).inc()
            error = f"shared-memory send failed: {e!r}"
            log.warning("KV send of %s to %s through shared memory failed: %s", rid, slot.worker_id, e)
            self._drop(slot)
        finally:
            await self._end_send(rid, error, span, started)
        if error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, error)
        reply = announce(kv.layout, kv.num_tokens, shape, 0, 0, first_block=kv.first_block, groups=kv.parts)
        reply.shm_bytes = kv.nbytes
        return reply

    async def _check_shape(
        self, context: grpc.aio.ServicerContext, rpc: str, request: Call | Unreadable, *ids: str
    ) -> Call:
        """`request`, known readable; else INVALID_ARGUMENT for an unreadable message, or one whose id fields
        are empty or too long."""
        if isinstance(request, Unreadable):
            await self._refuse(context, rpc, "?", f"the message is not a {request.kind}")
        for name in ids:
            value = getattr(request, name)
            if not value or len(value) > MAX_ID_CHARS:
                problem = "is empty" if not value else f"is longer than {MAX_ID_CHARS} characters"
                await self._refuse(context, rpc, request.decode_worker_id or "?", f"{name} {problem}")
        return request

    async def _refuse(self, context: grpc.aio.ServicerContext, rpc: str, worker: str, why: str) -> NoReturn:
        """Count and log the refusal, then abort the call with INVALID_ARGUMENT (raises)."""
        self.stats.refused += 1
        metrics.KV_TRANSFER_FAILURES.labels(self.model_name, "prefill", "invalid_request").inc()
        log.warning("refused %s from %s (worker %s): %s", rpc, context.peer(), short(worker), why)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc} refused: {why}")

    async def _authorize(
        self, context: grpc.aio.ServicerContext, rpc: str, ticket: str, worker: str, request_id: str | None = None
    ) -> None:
        """Pass if `ticket` lets `worker` make this call (pull `request_id`; None: connect); else refuse."""
        try:
            self._replays.admit(self._tickets.verify(ticket, worker, request_id))
        except TicketError as e:
            self.stats.refused += 1
            metrics.KV_TRANSFER_FAILURES.labels(self.model_name, "prefill", f"ticket_{e.reason}").inc()
            target = "" if request_id is None else f" of {short(request_id)}"
            log.warning(
                "refused %s%s from %s (worker %s): ticket %s: %s",
                rpc,
                target,
                context.peer(),
                short(worker),
                e.reason,
                e,
            )
            code = _TICKET_CODES.get(e.reason, grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(code, f"{rpc} refused, ticket {e.reason}: {e}")

    async def _joined(self, slot: Slot) -> Pair:
        """The slot's pair; the decode side joins before it pulls, so the wait is normally over already."""
        if slot.joining.done():
            return slot.joining.result()
        return await asyncio.wait_for(asyncio.shield(slot.joining), self.timeout_s)

    async def _check_fingerprint(self, fingerprint: str, context: grpc.aio.ServicerContext) -> None:
        ours = self.source.layout.fingerprint
        if fingerprint != ours:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"KV layout fingerprint {fingerprint!r} differs from ours {ours!r}"
            )

    def _post_now(self, pair: Pair, kv: Outgoing, tag: int) -> Callable[[], None]:
        """Post the send from the loop where that is cheap (loop_send.py), before the reply leaves; returns
        the blocking rest of the send (its wait, or the whole send on a thread), which raises if it failed."""
        faults = self.fault_send_midway or self.fault_send_stall_s
        parts = None if faults else loop_pieces(kv, self.backend, self.chunk_bytes)
        if parts is None:
            return functools.partial(self._send_blocking, pair, kv, tag)
        try:
            return pair.post_send(parts, tag).wait
        except Exception as e:  # the pair closed under us: the send task fails it as any failed send
            return functools.partial(_reraise, e)

    async def _send(self, slot: Slot, kv: Outgoing, finish: Callable[[], None], rid: str, span, started: float) -> None:
        """Finish the send (`finish` blocks: on a send thread), then end it whatever happened (the source
        frees the blocks).

        A failed send drops the pair: gloo has closed it already after an error or timeout, and closing it
        here too destroys the group once idle, so the receiver's pending recvs fail at once. An injected
        fault sends the first piece (none when the KV is one piece, so the fault always bites) and fails."""
        labels = (self.model_name, "prefill")
        error = None
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, finish)
            self.stats.bytes_sent += kv.nbytes
            metrics.KV_TRANSFER_BYTES.labels(*labels).inc(kv.nbytes)
            metrics.KV_TRANSFER_SECONDS.labels(*labels).observe(time.perf_counter() - started)
        except Exception as e:  # timeout, peer gone, pair closed under us, or the injected fault
            self.stats.failed_sends += 1
            metrics.KV_TRANSFER_FAILURES.labels(*labels, _failure_reason(e)).inc()
            error = f"send failed: {e!r}"
            log.warning("KV send of %s to %s failed: %s", rid, slot.worker_id, e)
            self._drop(slot)
        finally:
            await self._end_send(rid, error, span, started)

    async def _end_send(self, rid: str, error: str | None, span, started: float) -> None:
        """A send is over, on either path (pair or shared memory): the source frees the blocks, the span ends."""
        try:
            await self.source.end_send(rid, ok=error is None)
        except Exception:
            log.exception("ending the send of %s failed", rid)
        span.set_attribute(tracing.KV_DURATION, time.perf_counter() - started)
        tracing.end_span(span, error=error)

    def _send_blocking(self, pair: Pair, kv: Outgoing, tag: int) -> None:
        """On a send thread, on the send stream: returns once the send's work is done (its buffer is free)."""
        if isinstance(kv, PoolKv):  # host memory, straight from the blocks: no stream to order against
            parts = kv.pieces(self.chunk_bytes)
            if self.fault_send_midway or self.fault_send_stall_s:
                count = kv.num_pieces(self.chunk_bytes)
                first = list(itertools.islice(parts, 1 if count > 1 else 0))
                pair.send(first, tag)
                time.sleep(self.fault_send_stall_s)
                if self.fault_send_midway:
                    raise InjectedFault(f"injected fault: sent {len(first)} of {count} pieces, then dropped the pair")
                pair.send(parts, tag + len(first))
                return
            pair.send(parts, tag)
            return
        with self.send_stream.sending([kv.blocks]):
            # gloo sends host memory (a CUDA pool's export is copied down); NCCL sends from the GPU as is.
            blocks = (kv.blocks if self.backend is TransferBackend.NCCL else kv.blocks.cpu()).contiguous()
            parts = pieces(blocks, self.chunk_bytes)
            if self.fault_send_midway or self.fault_send_stall_s:
                sent = parts[:1] if len(parts) > 1 else []
                pair.send(sent, tag)
                time.sleep(self.fault_send_stall_s)
                if not self.fault_send_midway:
                    pair.send(parts[len(sent) :], tag + len(sent))
                    return
                raise InjectedFault(f"injected fault: sent {len(sent)} of {len(parts)} pieces, then dropped the pair")
            pair.send(parts, tag)

    def _join(self, pair_id: str, store_port: int) -> Pair:
        """Blocking: our rank of the pair's group, over a store connection of its own (to our store's port)."""
        store = store_client(self.public_host, store_port, self.timeout_s)
        pair = Pair.join(self.backend, store, pair_id, PREFILL_RANK, self.timeout_s, self.public_host)
        self._proofs.confirm(pair)  # PairRefused: a stranger joined first, or the peer never proved itself
        return pair

    def _on_joined(self, slot: Slot, joining: asyncio.Future[Pair]) -> None:
        if slot.segment is not None:  # the peer mapped it before joining (or never will): no name is needed
            slot.segment.unlink()
        if not joining.cancelled() and isinstance(joining.exception(), PairRefused):
            metrics.KV_TRANSFER_FAILURES.labels(self.model_name, "prefill", "pair_refused").inc()
        if joining.cancelled() or joining.exception() is not None:
            log.warning("pair %s did not form: %r", slot.pair_id, None if joining.cancelled() else joining.exception())
            self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        """Forget the pair (a later Pull naming it gets ABORTED) and close it."""
        if self._pairs.get(slot.worker_id) is slot:
            del self._pairs[slot.worker_id]
        slot.retire()


def _reraise(error: Exception) -> NoReturn:
    raise error


def _failure_reason(error: Exception) -> str:
    return "fault_injected" if isinstance(error, InjectedFault) else "send_failed"
