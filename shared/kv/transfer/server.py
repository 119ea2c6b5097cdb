"""Prefill side of the KV transfer plane: the gRPC `KvTransfer` service and the sends it starts.

One TCPStore per server is the rendezvous of all its pairs (one per decode worker, each under its own key
prefix). Threading: gRPC handlers run on the event loop; pair construction and send waits, which block,
run in this server's thread pool, so the loop (and the engine steps it drives) keeps going.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch.distributed as dist

from shared.engine.kv_export import KVExport
from shared.kv.transfer.pair import PREFILL_RANK, Backend, Pair, check_backend, store_client
from shared.kv.transfer.source import KvSource
from shared.kv.transfer.wire import describe
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc
from shared.telemetry import metrics, tracing

log = logging.getLogger(__name__)
MAX_BLOCKING_THREADS = 32  # joins + sends waiting at once; more queue for a free thread
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass
class ServerStats:
    pairs_created: int = 0  # Connect calls accepted: one process group each
    pulls: int = 0  # pulls accepted (export done, send started)
    bytes_sent: int = 0
    failed_sends: int = 0


@dataclass
class _Slot:
    """A decode worker's pair as the server knows it: being joined, or ready."""

    worker_id: str
    pair_id: str
    joining: asyncio.Future[Pair]
    tags: itertools.count  # per-pair transfer tags: 1, 2, ...


class KvTransferServer:
    """Serves pulls of the KV that `source` holds. `start()` binds; `stop()` waits for sends in flight."""

    def __init__(
        self,
        host: str,
        port: int,
        source: KvSource,
        backend: Backend | str = "gloo",
        timeout_s: float = 30.0,
        advertise_host: str | None = None,
        model_name: str = "",
    ) -> None:
        """host/port: where gRPC binds (port 0: any free one). advertise_host: the name decode workers dial
        for gRPC, the store and gloo (default: host, or this machine's FQDN when host is a wildcard).
        timeout_s bounds a pair's forming and each send; a send that times out frees the KV all the same.
        model_name labels this server's spans and metrics."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.host = host
        self.port = port
        self.source = source
        self.backend = check_backend(backend)
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.stats = ServerStats()
        # Where decode workers reach this machine, for the store and for gloo's listening socket.
        self.public_host = advertise_host or (socket.getfqdn() if host in WILDCARD_HOSTS else host)
        self._executor = ThreadPoolExecutor(MAX_BLOCKING_THREADS, thread_name_prefix="kv-send")
        self._pairs: dict[str, _Slot] = {}  # by decode worker id
        self._leased: set[str] = set()  # request ids between an accepted Pull and their release
        self._sends: set[asyncio.Task[None]] = set()
        self._store: dist.TCPStore | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Host the rendezvous store and start serving; returns the "host:port" decode workers dial."""
        self._store = dist.TCPStore(
            self.public_host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s)
        )
        self._server = grpc.aio.server()
        pb_grpc.add_KvTransferServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._server.start()
        return f"{self.public_host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; wait for the sends in flight (each ends within timeout_s) and their releases."""
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
        self._pairs.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._server = self._store = None

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    async def connect(self, request: pb.ConnectRequest, context: grpc.aio.ServicerContext) -> pb.ConnectReply:
        if not request.decode_worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_worker_id is empty")
        backend = Backend.from_wire(request.backend)
        if backend is not self.backend:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this server transfers over {self.backend}")
        await self._check_fingerprint(request.layout_fingerprint, context)
        worker = request.decode_worker_id
        pair_id = f"{worker}/{uuid.uuid4().hex[:12]}"
        joining = asyncio.get_running_loop().run_in_executor(self._executor, self._join, pair_id)
        # A reconnecting worker replaces its old pair: transfers still on it finish or fail on their own.
        self._pairs[worker] = slot = _Slot(worker, pair_id, joining, itertools.count(1))
        joining.add_done_callback(lambda f: self._on_joined(slot, f))
        self.stats.pairs_created += 1
        return pb.ConnectReply(store_host=self.public_host, store_port=self._store.port, pair_id=pair_id)

    async def pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullReply:
        """Accept a pull: export, announce, start the send. The `send_kv` span (child of the puller's span,
        from the gRPC metadata) covers export and send; the send task ends it."""
        metadata = dict(context.invocation_metadata() or ())
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

    async def _accept(self, request: pb.PullRequest, context: grpc.aio.ServicerContext, span) -> pb.PullReply:
        started = time.perf_counter()
        rid = request.request_id
        slot = self._pairs.get(request.decode_worker_id)
        if slot is None or slot.pair_id != request.pair_id:
            await context.abort(grpc.StatusCode.ABORTED, f"pair {request.pair_id!r} is not open here; connect again")
        await self._check_fingerprint(request.layout_fingerprint, context)
        if rid in self._leased:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already being pulled")
        try:
            pair = await self._joined(slot)
        except Exception as e:  # the join failed or hangs: this pair is no good
            self._drop(slot)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pair {slot.pair_id!r} did not form: {e!r}")
        self._leased.add(rid)
        try:
            kv = await self.source.export_kv(rid, request.ticket)
        except (KeyError, PermissionError) as e:
            self._leased.discard(rid)
            code = grpc.StatusCode.NOT_FOUND if isinstance(e, KeyError) else grpc.StatusCode.PERMISSION_DENIED
            await context.abort(code, str(e.args[0]) if e.args else repr(e))
        except BaseException:
            self._leased.discard(rid)
            raise
        span.set_attributes(
            {
                tracing.KV_EXPORT_TIME: time.perf_counter() - started,
                tracing.KV_BYTES: kv.nbytes,
                tracing.KV_TOKENS: kv.num_tokens,
            }
        )
        tag = next(slot.tags)
        task = asyncio.create_task(self._send(slot, pair, kv, tag, rid, span, started))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        self.stats.pulls += 1
        return describe(kv, tag)

    async def _joined(self, slot: _Slot) -> Pair:
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

    async def _send(self, slot: _Slot, pair: Pair, kv: KVExport, tag: int, rid: str, span, started: float) -> None:
        """Send on the pair, then free the blocks whatever happened (pulled → freed)."""
        labels = (self.model_name, "prefill")
        error = None
        try:
            # gloo sends host memory (a CUDA pool's export is copied down); NCCL sends from the GPU as is.
            blocks = (kv.blocks if self.backend is Backend.NCCL else kv.blocks.cpu()).contiguous()
            await asyncio.get_running_loop().run_in_executor(self._executor, pair.send, blocks, tag)
            self.stats.bytes_sent += kv.nbytes
            metrics.KV_TRANSFER_BYTES.labels(*labels).inc(kv.nbytes)
            metrics.KV_TRANSFER_SECONDS.labels(*labels).observe(time.perf_counter() - started)
        except Exception as e:  # timeout or peer gone: gloo has closed the pair
            self.stats.failed_sends += 1
            metrics.KV_TRANSFER_FAILURES.labels(*labels, "send_failed").inc()
            error = f"send failed: {e!r}"
            log.warning("KV send of %s to %s failed: %r", rid, slot.worker_id, e)
            self._drop(slot)
        finally:
            self._leased.discard(rid)
            try:
                await self.source.release_kv(rid)
            except Exception:
                log.exception("releasing the KV of %s failed", rid)
            span.set_attribute(tracing.KV_DURATION, time.perf_counter() - started)
            tracing.end_span(span, error=error)

    def _join(self, pair_id: str) -> Pair:
        """Blocking: our rank of the pair's group, over a store connection of its own."""
        store = store_client(self.public_host, self._store.port, self.timeout_s)
        return Pair.join(self.backend, store, pair_id, PREFILL_RANK, self.timeout_s, self.public_host)

    def _on_joined(self, slot: _Slot, joining: asyncio.Future[Pair]) -> None:
        if joining.cancelled() or joining.exception() is not None:
            log.warning("pair %s did not form: %r", slot.pair_id, None if joining.cancelled() else joining.exception())
            self._drop(slot)

    def _drop(self, slot: _Slot) -> None:
        if self._pairs.get(slot.worker_id) is slot:
            del self._pairs[slot.worker_id]


class _Servicer(pb_grpc.KvTransferServicer):
    def __init__(self, server: KvTransferServer) -> None:
        self._server = server

    async def Connect(self, request: pb.ConnectRequest, context: grpc.aio.ServicerContext) -> pb.ConnectReply:
        return await self._server.connect(request, context)

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullReply:
        return await self._server.pull(request, context)
