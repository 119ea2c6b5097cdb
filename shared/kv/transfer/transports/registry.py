"""The transports, in order of preference: the one place that lists them.

The server asks each in this order whether it takes a pull, and the client each whether a reply is its (base.py).
The borrowed pool (one copy, same host) comes first, then the shared segment (same host), then the sends over the
pair: layer-streamed (a property of the KV), into receives posted before the Pull, and plain, which takes every
pull and so comes last. The plug-ins import only base.py and their mechanisms, never this module: no cycle.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.kv.transfer.transports import borrowed, plain_pair, posted_pair, segment, streamed
from shared.kv.transfer.transports.base import Transport

TRANSPORTS: tuple[Transport, ...] = (
    borrowed.TRANSPORT,
    segment.TRANSPORT,
    streamed.TRANSPORT,
    posted_pair.TRANSPORT,
    plain_pair.TRANSPORT,
)
FALLBACK = plain_pair.TRANSPORT  # takes every pull: always in a server's and a client's list


def by_name(names: Iterable[str]) -> tuple[Transport, ...]:
    """The registered transports named (in registry order), with the fallback; ValueError for an unknown name."""
    wanted = set(names)
    unknown = wanted - {t.name for t in TRANSPORTS}
    if unknown:
        raise ValueError(f"unknown KV transports {sorted(unknown)}; known: {[t.name for t in TRANSPORTS]}")
    return tuple(t for t in TRANSPORTS if t.name in wanted or t is FALLBACK)


def with_fallback(transports: Iterable[Transport]) -> tuple[Transport, ...]:
    """`transports` in the order given, the fallback last (added when missing)."""
    chosen = [t for t in transports if t is not FALLBACK]
    return (*chosen, FALLBACK)
