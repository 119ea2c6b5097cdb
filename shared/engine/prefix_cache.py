"""The cached blocks of one block manager: which full blocks hold the K/V of which prefix (by hash), and which
of them may be evicted.

A full block whose K/V is computed gets its prefix hash (shared/prefix_hash.py) and keeps it while it stays in
the pool. When the last request holding it lets go (reference count 0) the block is not free: it is *evictable*,
at the young end of an LRU, and a later request with the same prefix takes it back. Only when the free blocks run
out does the block manager evict the oldest evictable block (its hash is dropped and it is free again).

Invariant (BlockManager.check_integrity): every hashed block is referenced or evictable, never both; hash → block
and block → hash are each other's inverse; an evictable block has no references.

The cache of KV cache group 0 also records events for routing (`CacheEvents`): the hashes that became cached and
those evicted since the consumer last asked, netted out, so that applying `removed` and `stored` in either order
to the consumer's last view gives the view now.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# Changes pending before the consumer asks; past this they are dropped and the consumer takes a snapshot instead.
MAX_PENDING_EVENTS = 10_000


@dataclass(frozen=True)
class PrefixCacheEvents:
    """What changed in group 0's cached hashes since the previous call (shared/engine/engine.py
    `prefix_cache_events`). overflowed: too many changes were pending and were dropped; `stored` and `removed`
    are then empty and the consumer should replace its view with a snapshot (`prefix_cache_hashes`)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    overflowed: bool = False


class CacheEvents:
    """Net changes to a set of hashes since the last `take`, bounded by `limit` (module doc)."""

    def __init__(self, limit: int = MAX_PENDING_EVENTS) -> None:
        self.limit = limit
        # insertion-ordered sets: a hash is in at most one of them
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._overflowed = False

    def stored(self, h: int) -> None:
        if self._overflowed:
            return
        if h in self._removed:  # held at the last take, evicted, and back: no net change
            del self._removed[h]
            return
        self._stored[h] = None
        self._check_size()

    def removed(self, h: int) -> None:
        if self._overflowed:
            return
        if h in self._stored:  # not held at the last take: no net change
            del self._stored[h]
            return
        self._removed[h] = None
        self._check_size()

    def _check_size(self) -> None:
        if len(self._stored) + len(self._removed) > self.limit:
            self._stored.clear()
            self._removed.clear()
            self._overflowed = True

    def take(self) -> PrefixCacheEvents:
        """The pending changes (or the overflow), and start afresh from the view now."""
        out = PrefixCacheEvents(list(self._stored), list(self._removed), self._overflowed)
        self._stored, self._removed, self._overflowed = {}, {}, False
        return out


class PrefixCache:
    """Hash ↔ block of one block manager's cached blocks, and the LRU of the evictable ones. Knows nothing of
    reference counts: the block manager tells it when a block's last reference goes (`park`) or a parked block
    is taken again (`unpark`)."""

    def __init__(self, events: CacheEvents | None = None) -> None:
        self._block_of: dict[int, int] = {}  # hash → block
        self._hash_of: dict[int, int] = {}  # block → hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # blocks at reference count 0, oldest first
        self.events = events  # None: no one routes by this cache (a window group's)
        self.evictions = 0  # blocks evicted so far

    @property
    def num_cached(self) -> int:
        """Cached blocks, referenced or evictable."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def block_of(self, h: int) -> int | None:
        return self._block_of.get(h)

    def hash_of(self, block: int) -> int | None:
        return self._hash_of.get(block)

    def hashes(self) -> list[int]:
        return list(self._block_of)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def add(self, block: int, h: int) -> bool:
        """Name a referenced `block` by `h` unless either is taken (another block with the same K/V keeps the
        name; this one then stays unnamed and is freed as usual). True if `block` is now named `h`."""
        if self._block_of.get(h) == block:
            return True
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h], self._hash_of[block] = block, h
        if self.events is not None:
            self.events.stored(h)
        return True

    def park(self, block: int) -> None:
        """`block` (hashed) lost its last reference: evictable, the youngest."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """An evictable `block` is referenced again (a prefix hit)."""
        del self._evictable[block]

    def evict(self) -> int:
        """The oldest evictable block, its hash dropped: the caller frees it. KeyError if none."""
        block, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._block_of[h]
        self.evictions += 1
        if self.events is not None:
            self.events.removed(h)
        return block

    def check(self, refs: list[int]) -> set[int]:
        """Raise AssertionError where the maps, the LRU and the reference counts `refs` disagree (module doc);
        → the evictable blocks."""
        inverse = all(self._hash_of.get(b) == h for h, b in self._block_of.items())
        if len(self._block_of) != len(self._hash_of) or not inverse:
            raise AssertionError("the prefix cache's hash → block and block → hash maps disagree")
        evictable = set(self._evictable)
        if not evictable <= self._hash_of.keys():
            raise AssertionError(f"evictable blocks without a hash: {sorted(evictable - self._hash_of.keys())[:10]}")
        for b in self._hash_of:
            if (refs[b] == 0) != (b in evictable):
                state = "evictable" if b in evictable else "not evictable"
                raise AssertionError(f"cached block {b} has {refs[b]} references and is {state}")
        return evictable
