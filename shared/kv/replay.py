"""Single use of KV transfer tickets: the verifier remembers the nonce of every ticket it accepted until
that ticket expires, and refuses a second use.

Memory is bounded: an entry lives until its ticket's own expiry (plus the skew allowance the verifier grants;
after that the ticket is refused as expired anyway), and at most `capacity` entries live at once. A full cache
refuses new tickets (OVERLOADED) rather than forgetting live ones early: forgetting would let a copied ticket
through again. Sizing: a worker that accepts N calls per second holds about N × (lifetime + skew) entries
(65 s by default), about 150 bytes each.

Expired entries leave in expiry order (a heap) at the next admit: each entry is pushed and popped once, so
an admit costs O(log n) amortized. The clock is the verifier's wall clock, the one expiry is checked
against. Not thread-safe: the transfer server calls it from its event loop only.
"""

from __future__ import annotations

import heapq
import time

from shared.kv.tickets import Claims, TicketError, TicketReason

DEFAULT_CAPACITY = 1 << 18  # ~4000 calls/s at the default 65 s window; ~40 MB when full


class ReplayCache:
    """Nonces of accepted, unexpired tickets. `admit` is the one operation: accept once, refuse again."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, skew_s: float = 0.0) -> None:
        """capacity: the most live entries (a full cache refuses). skew_s: how long past its expiry a
        ticket still verifies (Tickets.skew_s): its entry must live that long too."""
        if capacity < 1 or skew_s < 0:
            raise ValueError(f"capacity must be at least 1 and skew_s >= 0, got {capacity} and {skew_s}")
        self.capacity = capacity
        self.skew_s = skew_s
        self._until: dict[str, float] = {}  # nonce → when its entry may go
        self._heap: list[tuple[float, str]] = []  # the same entries, soonest first

    def __len__(self) -> int:
        return len(self._until)

    def admit(self, claims: Claims, *, now: float | None = None) -> None:
        """Record `claims`' ticket as used; TicketError REPLAYED if it was used before, OVERLOADED if the cache
        is full of unexpired entries. Call only after the ticket verified (its claims are signed)."""
        now = time.time() if now is None else now
        self._expire(now)
        if claims.nonce in self._until:
            raise TicketError(TicketReason.REPLAYED, f"the ticket was used already (nonce {claims.nonce[:8]}…)")
        if len(self._until) >= self.capacity:
            raise TicketError(
                TicketReason.OVERLOADED,
                f"{len(self._until)} tickets accepted within their lifetime: the replay cache is full, retry later",
            )
        until = claims.expires_s + self.skew_s
        self._until[claims.nonce] = until
        heapq.heappush(self._heap, (until, claims.nonce))

    def _expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            _, nonce = heapq.heappop(heap)
            del self._until[nonce]
