"""Prefill side of the KV transfer plane: the gRPC `KvTransfer` service. It authenticates, negotiates a pair per
decode worker (Connect) and dispatches each accepted pull to the first transport that takes it (transports/: the
borrowed pool, the shared segment, the pair's layer-streamed, posted and plain sends; docs/kv_transfer.md).

One TCPStore per server is the rendezvous of all its pairs (one per decode worker, each under its own key
prefix). Threading: gRPC handlers run on the event loop; pair construction and send waits, which block, run in
this server's thread pool, so the loop (and the engine steps it drives) keeps going. Clients send their pulls as
messages of one PullStream per pair (pull_stream.py), or over the server's Unix socket on one host
(local_stream.py); each goes through `pull`, as a unary Pull does, and gets its own answer. `stop` ends the open
streams (UNAVAILABLE) before it waits for calls.

Every call is checked before it touches anything: readable message, ids present and of sane length,
then a ticket signed with the cluster secret for this caller (and, on Pull, this request), used for the
first time (replay.py: each ticket is single-use). With `tls` the gRPC port speaks only TLS and requires a
client certificate signed by the deployment's CA (channel_tls.py). A pair is used only after its peer proved
it holds the cluster secret (pair_proof.py); its id is unguessable, yet not secret from the store. A refused call
changes nothing (the KV stays held), is logged with its reason (never the ticket) and counted in
`pdserve:kv_transfer_failures_total`. `fault_send_midway` (tests only) stops each send after its first piece (or
half the bytes, in shared memory) and drops the pair; `fault_send_stall_s` (tests only) sleeps there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import grpc
import torch.distributed as dist

from shared.engine.shared_pool import PoolHandle
from shared.kv.replay import DEFAULT_CAPACITY
from shared.kv.transfer import pull_stream
from shared.kv.transfer.call_checks import MAX_ID_CHARS, CallChecks
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.heads import HeadsRefused, begin_send
from shared.kv.transfer.local_stream import LocalListener
from shared.kv.transfer.pair import PREFILL_RANK, Pair, TransferBackend, check_backend, store_client
from shared.kv.transfer.pair_proof import PairProofs, PairRefused
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES, Unreadable, handler
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.shm import host_identity, sweep_stale
from shared.kv.transfer.skip import skip_cached
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.source import AlreadySending, KvSource
from shared.kv.transfer.transports.base import Sender, Transport
from shared.kv.transfer.transports.registry import TRANSPORTS, with_fallback
from shared.kv.transfer.transports.sends import SendJob, Sends, SendSettings, ServerStats
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics, tracing

# torch.distributed re-exports its C++ stores (Store, TCPStore, PrefixStore) without marking them public.
# pyright: reportPrivateImportUsage=false

log = logging.getLogger(__name__)
MAX_BLOCKING_THREADS = 32  # joins + sends waiting at once; more queue for a free thread
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
DEFAULT_CHUNK_BYTES = 64 << 20  # KV of up to this size moves in one piece
MIN_CHUNK_BYTES = 1024
SERVICE = pb.DESCRIPTOR.services_by_name["KvTransfer"].full_name
PAIR_ID_BYTES = 24  # of CSPRNG output in each pair id
DEFAULT_SHM_BYTES = 256 << 20  # a same-host pair's segment: KV up to this size skips the socket
__all__ = ["MAX_ID_CHARS", "KvTransferServer", "ServerStats"]


def _send_setting(name: str) -> property:
    """A server attribute that reads and writes the setting of its sends' (transports/sends.py)."""

    def get(server: KvTransferServer) -> Any:
        return getattr(server._sends.settings, name)

    def put(server: KvTransferServer, value: Any) -> None:
        setattr(server._sends.settings, name, value)

    return property(get, put)


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
        transports: Sequence[Transport] = TRANSPORTS,
    ) -> None:
        """host/port: where gRPC binds (port 0: any free one). secret: the cluster secret tickets are
        signed with (at least 16 bytes). advertise_host: the name decode workers dial for gRPC, the store
        and gloo (default: host, or this machine's FQDN when host is a wildcard). timeout_s bounds a pair's
        forming and each send; a send that times out frees the KV all the same. chunk_bytes: the largest
        piece a send moves (0 = one piece). fault_send_midway: testing only, every send fails after its first
        piece (transports/over_pair.py). model_name labels this server's spans and metrics. send_stream: the stream
        sends run on, shared with the source's exports (send_stream.py; None: no stream, as on CPU). tls: serve gRPC
        over TLS with client certificates (None: plaintext). replay_capacity: the most unexpired tickets
        remembered against replay. ticket_holder: the id a caller's pull ticket must name (a group rank's: its
        group's, shared/kv/rank_transfer.py); None: the caller's own. shm_bytes: the size of the shared
        segment a same-host pair gets (0: no shared memory, every pull over the pair). fault_send_stall_s:
        testing only, every send sleeps this long midway (after its first piece, or half its bytes in shared
        memory), so that a test can kill this process mid-transfer. shared_pool: the source's pool in a memfd
        (shared/engine/shared_pool.py): a same-host pair whose pulls go over the Unix socket maps it, and borrows
        a request's blocks in place instead of a copy (borrow.py). transports: those offered, in order of
        preference (transports/registry.py; the plain pair send is always last)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if chunk_bytes != 0 and chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 0 (one piece) or at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
        self.host = host
        self.port = port
        self.source = source
        self.backend = check_backend(backend)
        self.timeout_s = timeout_s
        self.host_id = host_identity() if shm_bytes else ""
        self.model_name = model_name
        self.stats = ServerStats()
        self._checks = CallChecks(secret, replay_capacity, self.stats, model_name, lambda: source.layout, log)
        self._proofs = PairProofs(secret)
        self.tls = tls
        self._ticket_holder = ticket_holder or (lambda worker: worker)
        # Where decode workers reach this machine, for the store and for gloo's listening socket.
        self.public_host = advertise_host or (socket.getfqdn() if host in WILDCARD_HOSTS else host)
        self._executor = ThreadPoolExecutor(MAX_BLOCKING_THREADS, thread_name_prefix="kv-send")
        settings = SendSettings(
            self.backend, timeout_s, chunk_bytes, model_name, send_stream or SendStream("cpu"), fault_send_midway,
            fault_send_stall_s, self.host_id, shm_bytes, shared_pool if self.host_id else None,
        )  # fmt: skip
        self._sends = Sends(settings, source, self.stats, self._executor, self._drop)
        # the transports this server offers, in order: each takes a pull or passes it on (transports/base.py)
        self._senders: list[Sender] = [
            sender for t in with_fallback(transports) if (sender := t.server(self._sends)) is not None
        ]
        self._pairs: dict[str, Slot] = {}  # by decode worker id
        self._issued: set[str] = set()  # every pair id handed out: one Connect's worth of bytes each
        self._streams: set[grpc.aio.ServicerContext] = set()  # of the PullStream calls open (one per pair)
        # Same host: the Unix socket a pair's pulls may come over instead of gRPC (local_stream.py)
        self._local = LocalListener(self.pull, MAX_MESSAGE_BYTES, timeout_s) if self.host_id else None
        self._store: dist.TCPStore | None = None
        self._server: grpc.aio.Server | None = None

    # The send settings live with the transports (`Sends.settings`); a test may change them between pulls.
    chunk_bytes = _send_setting("chunk_bytes")
    fault_send_midway = _send_setting("fault_send_midway")
    fault_send_stall_s = _send_setting("fault_send_stall_s")
    shm_bytes = _send_setting("shm_bytes")

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
        await self._sends.wait_all()
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
        request = await self._checks.shape(context, "Connect", request, "decode_worker_id")
        worker = request.decode_worker_id
        await self._checks.authorize(context, "Connect", request.ticket, worker)
        backend = TransferBackend.from_wire(request.backend)
        if backend is None:
            await self._checks.refuse(context, "Connect", worker, f"unknown transfer backend {request.backend}")
        if backend is not self.backend:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this server transfers over {self.backend}")
        await self._checks.fingerprint(request.layout_fingerprint, context)
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
        if self._local is not None and request.host_id == self.host_id:  # same host: the Unix socket carrier
            reply.local_stream = self._local.name
        for sender in self._senders:  # each transport offers itself to the pair (or not)
            await sender.offer(slot, request, reply)
        return reply

    async def pull(self, request: pb.PullRequest | Unreadable, context: grpc.aio.ServicerContext) -> pb.PullReply:
        """Accept a pull: check, export, announce, start the send. The `send_kv` span (child of the puller's
        span, from the gRPC metadata) covers export and send; the send task ends it."""
        request = await self._checks.shape(context, "Pull", request, "request_id", "decode_worker_id", "pair_id")
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
        await self._checks.authorize(context, "Pull", request.ticket, self._ticket_holder(worker), rid)
        slot = self._pairs.get(worker)
        if slot is None or slot.pair_id != request.pair_id:
            await context.abort(grpc.StatusCode.ABORTED, f"pair {request.pair_id!r} is not open here; connect again")
        await self._checks.fingerprint(request.layout_fingerprint, context)
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
        kv = skip_cached(kv, request.skip_tokens)  # a partial pull: the decode side holds the first tokens
        span.set_attributes(
            {
                tracing.KV_EXPORT_TIME: time.perf_counter() - started,
                tracing.KV_BYTES: kv.nbytes,
                tracing.KV_TOKENS: kv.num_tokens,
            }
        )
        self.stats.pulls += 1
        lender = getattr(context, "lender", None)  # a message of a same-host pair's Unix socket
        job = SendJob(request, kv, slot, pair, span, started, context, lender)
        for sender in self._senders:  # the first transport that takes the pull sends it, and ends it
            try:
                reply = await sender.send(job)
            except BaseException:  # it took the pull, ended it, and aborts the call
                self._took(sender.name)
                raise
            if reply is not None:
                self._took(sender.name)
                return reply
        raise AssertionError("the plain pair send takes every pull")  # the fallback is always in the list

    def _took(self, transport: str) -> None:
        self.stats.by_transport[transport] += 1
        metrics.KV_PULLS.labels(self.model_name, "prefill", transport).inc()

    async def _joined(self, slot: Slot) -> Pair:
        """The slot's pair; the decode side joins before it pulls, so the wait is normally over already."""
        if slot.joining.done():
            return slot.joining.result()
        return await asyncio.wait_for(asyncio.shield(slot.joining), self.timeout_s)

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
