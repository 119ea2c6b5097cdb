"""How the n choices of one request are named and seeded: one rule, read by the gateway (which names the choices
on the wire and derives their seeds), the workers and the engine (shared/engine/fork.py).

Choice 0 is the request itself (its id, its seed). Choice i > 0 is a request of its own on the wire, named
`<request>_c<i>` (its events, holder, ordering, deadlines and moves are a single request's), seeded `seed + i`:
so choice i of a seeded request equals a single request with seed + i, and an unseeded one draws independently.
"""

from __future__ import annotations


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (None stays None: independent draws)."""
    return None if seed is None else seed + index


def choice_request_id(request_id: str, index: int) -> str:
    """The wire request id of choice `index` (safe as a NATS subject token when `request_id` is)."""
    return request_id if index == 0 else f"{request_id}_c{index}"
