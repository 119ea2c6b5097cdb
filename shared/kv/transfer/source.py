"""The two halves of held KV as the transfer plane sees it.

- `KvSource`: what the transfer server asks of a prefill worker: is a send of this request in flight, start
  one (a copy of its KV to send), end it. `shared.kv.held.HeldKv` is the prefill worker's; it owns the
  hand-off state (held → sending → freed), its lease timer and its Redis entry.
- `KvBlocks` / `EngineKvBlocks`: what `HeldKv` asks of the engine: a request's KV to send (on a host
  pool, its blocks themselves: `PoolKv`, sent without an export pass; on CUDA, an export copy), free them.
  No state of the hand-off lives here, only which staging buffer each send borrowed.
Who may pull is not the source's business: the transfer server checks the puller's ticket before it asks.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.engine.layer_streams import StreamStart
from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.pool_kv import MIN_SEGMENT_BYTES, SMALL_KV_BYTES, PoolKv
from shared.kv.transfer.send_stream import SendStream

Outgoing = KVExport | PoolKv  # what a send moves: an export copy, or the request's pool blocks


class AlreadySending(Exception):
    """`begin_send` of a request whose send is in flight (the server answers ALREADY_EXISTS)."""


class KvSource(Protocol):
    """Held KV, lent out to pulls the server accepted. Every method runs on the server's event loop."""

    @property
    def layout(self) -> KVLayout:
        """The layout of every export; pairs and pulls with another fingerprint are refused."""
        ...

    # The id is positional-only: implementations name it as they like (HeldKv: the attempt key).
    def is_sending(self, request_id: str, /) -> bool:
        """A send of the request is in flight (between `begin_send` and `end_send`)."""
        ...

    async def begin_send(self, request_id: str, /) -> Outgoing:
        """The request's KV to send (a copy, or its blocks); they stay held until `end_send`. Raises KeyError for a
        request it does not hold, AlreadySending for one being sent. A raise leaves nothing to end."""
        ...

    async def end_send(self, request_id: str, /, ok: bool) -> None:
        """The send that `begin_send` started is over (sent, or failed: ok=False); called exactly once per
        successful `begin_send`. What becomes of the blocks is the source's call (HeldKv frees them)."""
        ...


class KvBlocks(Protocol):
    """A request's KV blocks in one engine, as the holder of the request sees them."""

    @property
    def layout(self) -> KVLayout: ...

    async def export_kv(self, request_id: str) -> Outgoing:
        """The request's KV to send: a copy, or (PoolKv) its blocks as they lie; the blocks stay allocated."""
        ...

    async def release_kv(self, request_id: str) -> None:
        """Free the request's blocks (and whatever its export borrowed). Called once per held request."""
        ...


class EngineKvBlocks:
    """KvBlocks over one Engine's requests added with hold_kv=True.

    `call(fn)` runs fn(engine) where the engine lives: pass the worker's `AsyncEngine.call` when a thread
    steps the engine; the default runs it inline (tests and benchmarks that step on the loop). On a host pool
    `export_kv` answers a `PoolKv` (pool_kv.py: sent straight from the blocks; `from_pool=False` restores the
    export copy); on CUDA an export copy, gathered on `send_stream` (off the compute stream; pass the same one
    to the KvTransferServer, send_stream.py). Copies and staging go into reused buffers (no first-touch page
    faults), each given back when its request is released, which `HeldKv` does only after the send.
    """

    def __init__(
        self,
        engine: Engine,
        call: Callable[[Callable[[Engine], Any]], Awaitable[Any]] | None = None,
        buffer_bytes: int = 256 << 20,
        send_stream: SendStream | None = None,
        from_pool: bool = True,
    ) -> None:
        self.engine = engine
        self.from_pool = from_pool and engine.pool.tensor.device.type == "cpu"
        self.small_kv_bytes = SMALL_KV_BYTES  # PoolKv.plan's thresholds (pool_kv.py)
        self.min_segment_bytes = MIN_SEGMENT_BYTES
        self.send_stream = send_stream or SendStream("cpu")
        self._call = call or _inline(engine)
        self._buffers = BufferPool(buffer_bytes, str(engine.pool.tensor.device))
        self._buffers_lock = threading.Lock()  # taken on the engine's thread, given back on the loop
        self._lent: dict[str, torch.Tensor] = {}  # request id → the buffer its export copied into
        # request id → its layer stream (layer_stream.py), from its last chunk's start until it is released;
        # written on the engine's thread, read on the loop (one dict operation each, atomic under the GIL)
        self._streams: dict[str, StreamStart] = {}

    def watch(self, engine: Engine, request_id: str, announce: Callable[[StreamStart], None]) -> None:
        """On the engine's thread: stream the request's KV layer by layer (Engine.stream_kv). When its last
        chunk starts, `announce(start)` is called there (hand it to the loop: `call_soon_threadsafe`); from then
        on `export_kv` lends the blocks as a `StreamedPoolKv` without waiting for the engine's thread."""

        def started(start: StreamStart) -> None:
            self._streams[request_id] = start
            announce(start)

        engine.stream_kv(request_id, started)

    def stop_stream(self, request_id: str, why: str) -> None:
        """Fail the request's layer stream if it is still running (its send then fails and ends); any thread."""
        start = self._streams.get(request_id)
        if start is not None:
            start.progress.fail(why)

    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    async def export_kv(self, request_id: str) -> Outgoing:
        start = self._streams.get(request_id)
        if start is not None:  # its last chunk may be running: not through the engine's thread (busy with it)
            kv = StreamedPoolKv.of_stream(self.engine.pool, start, self._take, self.min_segment_bytes)
        else:
            kv = await self._call(lambda e: self._export(e, request_id))
        lent = kv.blocks if isinstance(kv, KVExport) else kv.staging
        if lent is not None:
            self._lent[request_id] = lent
        return kv

    async def release_kv(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        # a streamed request whose step failed is not finished: aborting it frees its blocks all the same
        await self._call(lambda e: e.release_kv(request_id) or (request_id in e.requests and e.abort(request_id)))
        lent = self._lent.pop(request_id, None)
        if lent is not None:
            with self._buffers_lock:
                self._buffers.give_back(lent)

    def _export(self, engine: Engine, request_id: str) -> Outgoing:
        # on the engine's thread: the block table is read where it is written. A model of several KV cache
        # groups (shared/engine/kv_groups.py) exports: its groups' blocks travel as one flat tensor (wire.py).
        if self.from_pool and len(engine.pools) == 1:
            num_tokens, block_ids, first_block = engine.kv_blocks(request_id)
            return PoolKv.plan(
                engine.pool,
                num_tokens,
                block_ids,
                self._take,
                self.small_kv_bytes,
                self.min_segment_bytes,
                first_block=first_block,
            )
        with self.send_stream.exporting():
            return engine.export_kv(request_id, alloc=self._take)

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._buffers_lock:
            return self._buffers.take(shape, dtype)


def _inline(engine: Engine) -> Callable[[Callable[[Engine], Any]], Awaitable[Any]]:
    async def call(fn: Callable[[Engine], Any]) -> Any:
        return fn(engine)

    return call
