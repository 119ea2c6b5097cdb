"""What the transfer server needs from a prefill worker (`KvSource`), and the plain engine-backed one.

Ownership: a request whose KV a source holds is *prefilled*; once its location and ticket are published
it is *leased* (the holder's lease timer frees it if nobody pulls); `export_kv` + the send make it
*pulled*; `release_kv` after the send makes it *freed*. docs/kv_transfer.md has the whole table.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout


class KvSource(Protocol):
    """Held KV, lent out behind tickets. Both methods run on the server's event loop."""

    @property
    def layout(self) -> KVLayout:
        """The layout of every export; pairs and pulls with another fingerprint are refused."""
        ...

    async def export_kv(self, request_id: str, ticket: str) -> KVExport:
        """A copy of the request's KV; the blocks stay held. Raises KeyError for a request it does not
        hold, PermissionError for a wrong ticket."""
        ...

    async def release_kv(self, request_id: str) -> None:
        """Free the request's blocks. Called once after every accepted pull, sent or not; must be a no-op
        for a request already freed (a lease that expired or a cancel got there first)."""
        ...


class EngineKvSource:
    """A KvSource over one Engine's held requests (added with hold_kv=True), tickets kept in memory.

    The engine is single-threaded: its owner must not run `engine.step()` in another thread while this
    source's methods run on the loop (step on the loop, or wrap both in one lock)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tickets: dict[str, str] = {}

    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    def hold(self, request_id: str) -> str:
        """Register a finished request holding its KV; returns the ticket a puller must present."""
        if request_id not in self.engine.requests:
            raise KeyError(f"the engine holds no request {request_id!r}")
        ticket = secrets.token_urlsafe(16)
        self._tickets[request_id] = ticket
        return ticket

    @property
    def held(self) -> list[str]:
        return list(self._tickets)

    async def export_kv(self, request_id: str, ticket: str) -> KVExport:
        expected = self._tickets.get(request_id)
        if expected is None:
            raise KeyError(f"no KV held for request {request_id!r}")
        if not secrets.compare_digest(ticket.encode(), expected.encode()):
            raise PermissionError(f"wrong ticket for request {request_id!r}")
        return self.engine.export_kv(request_id)

    async def release_kv(self, request_id: str) -> None:
        if self._tickets.pop(request_id, None) is not None:
            self.engine.release_kv(request_id)
