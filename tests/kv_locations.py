"""An in-memory stand-in for the Redis KV locations a prefill worker writes (`shared.kv.held.Locations`)."""

from __future__ import annotations

from shared.kv.registry import KvLocation


class Registry:
    """The location entries by request id: written by `put`, removed by `delete` (what the hand-off frees)."""

    def __init__(self) -> None:
        self.entries: dict[str, KvLocation] = {}

    async def put(self, loc: KvLocation) -> None:
        self.entries[loc.request_id] = loc

    async def delete(self, request_id: str) -> None:
        self.entries.pop(request_id, None)
