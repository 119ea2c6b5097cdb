"""A fake engine's prefix-cache side (the API of Engine.prefix_cache_events / prefix_cache_hashes), for the tests
of block announcements and KV-aware routing that need no real engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Events:
    stored: list[int]
    removed: list[int]
    overflowed: bool


@dataclass
class FakePrefixEngine:
    """The prefix-cache side of Engine: what it holds, and the changes since the last prefix_cache_events()."""

    held: set[int] = field(default_factory=set)
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    overflowed: bool = False

    def cache(self, *hashes: int) -> None:
        self.held.update(hashes)
        self.stored += hashes

    def evict(self, *hashes: int) -> None:
        self.held.difference_update(hashes)
        self.removed += hashes

    def prefix_cache_events(self) -> Events:
        events = Events(self.stored, self.removed, self.overflowed)
        self.stored, self.removed, self.overflowed = [], [], False
        return events

    def prefix_cache_hashes(self) -> list[int]:
        return sorted(self.held)
