"""What the transfer server needs from a prefill worker (`KvSource`), and the plain engine-backed one.

Ownership: a request whose KV a source holds is *prefilled*; once its location is published it is
*leased* (the holder's lease timer frees it if nobody pulls); `export_kv` + the send make it *pulled*;
`release_kv` after the send makes it *freed*. docs/kv_transfer.md has the whole table. Who may pull is not
the source's business: the transfer server checks the puller's ticket before it asks for an export.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.buffers import BufferPool


class KvSource(Protocol):
    """Held KV, lent out to pulls the server accepted. Both methods run on the server's event loop."""

    @property
    def layout(self) -> KVLayout:
        """The layout of every export; pairs and pulls with another fingerprint are refused."""
        ...

    async def export_kv(self, request_id: str) -> KVExport:
        """A copy of the request's KV; the blocks stay held. Raises KeyError for a request it does not hold."""
        ...

    async def release_kv(self, request_id: str) -> None:
        """Free the request's blocks. Called once after every accepted pull, sent or not; must be a no-op
        for a request already freed (a lease that expired or a cancel got there first)."""
        ...


class EngineKvSource:
    """A KvSource over one Engine's held requests (added with hold_kv=True and registered with `hold`).

    `call(fn)` runs fn(engine) where the engine lives: pass the worker's `AsyncEngine.call` when a thread
    steps the engine; the default runs it inline (tests and benchmarks that step on the loop). Exports copy
    into reused buffers (no first-touch page faults), each returned when its request is released, which
    the transfer server does only after the send. `on_release(request_id)` runs after the blocks are freed
    (the prefill worker deletes the Redis entry there).
    """

    def __init__(
        self,
        engine: Engine,
        call: Callable[[Callable[[Engine], Any]], Awaitable[Any]] | None = None,
        on_release: Callable[[str], Awaitable[None]] | None = None,
        buffer_bytes: int = 256 << 20,
    ) -> None:
        self.engine = engine
        self._call = call or _inline(engine)
        self._on_release = on_release
        self._held: set[str] = set()
        self._buffers = BufferPool(buffer_bytes, str(engine.pool.tensor.device))
        self._buffers_lock = threading.Lock()  # taken on the engine's thread, given back on the loop
        self._exported: dict[str, torch.Tensor] = {}  # request id → the buffer its send reads

    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    def hold(self, request_id: str) -> None:
        """Register a finished request holding its KV: pullable from now until `release_kv`."""
        self._held.add(request_id)

    @property
    def held(self) -> list[str]:
        return list(self._held)

    def is_sending(self, request_id: str) -> bool:
        """An export of it is out: only the transfer server's release may free it now."""
        return request_id in self._exported

    async def export_kv(self, request_id: str) -> KVExport:
        if request_id not in self._held:
            raise KeyError(f"no KV held for request {request_id!r}")
        kv = await self._call(lambda e: e.export_kv(request_id, alloc=self._take))
        self._exported[request_id] = kv.blocks
        return kv

    async def release_kv(self, request_id: str) -> None:
        if request_id not in self._held:
            return
        self._held.discard(request_id)
        await self._call(lambda e: e.release_kv(request_id))
        exported = self._exported.pop(request_id, None)
        if exported is not None:
            with self._buffers_lock:
                self._buffers.give_back(exported)
        if self._on_release is not None:
            await self._on_release(request_id)

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._buffers_lock:
            return self._buffers.take(shape, dtype)


def _inline(engine: Engine) -> Callable[[Callable[[Engine], Any]], Awaitable[Any]]:
    async def call(fn: Callable[[Engine], Any]) -> Any:
        return fn(engine)

    return call
