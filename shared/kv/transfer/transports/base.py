"""The interface every KV transport implements, and what the server and the client hand it.

A transport is one way a pull's bytes move (lent in place, written into a shared segment, sent over the pair's
collective group, …). It has two halves:

- the **server half** (`Sender`, one per server, made by `Transport.server` from the server's `Sends`): in Connect
  it `offer`s itself to a pair (fields of the reply, state kept on the pair's `Slot`); for each accepted pull it
  either `send`s it (and answers the Pull) or declines (None: the next transport is asked);
- the **client half** (`Receiver`, one per pair, made by `Transport.connect` from the Connect reply; None when the
  pair was not offered this transport or cannot take it; each call is handed the formed pair, a `Link`): before
  a Pull it may `prepare` an `Offer` (fields of the request, memory it set aside); from the reply it either
  `receive`s the KV into the caller's buffers (an `Arrival`) or declines (None).

Negotiation is the order of the list (registry.py): the server sends with the first transport that takes a pull,
and the client receives with the first whose `receive` recognises the reply. The collective pair's plain send is
last and takes every pull. Carriers (the gRPC PullStream, the same-host Unix socket) and authentication (tickets,
pair proofs, TLS) are the server's and the client's business, never a transport's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.transports.receives import Link, Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.rpc import kv_transfer_pb2 as pb


class Sender(Protocol):
    """A transport's server half."""

    name: str

    async def offer(self, slot: Slot, hello: pb.ConnectRequest, reply: pb.ConnectReply) -> None:
        """Offer this transport to a new pair: set the fields of `reply` the client reads (and keep per-pair state
        on `slot`), or leave them unset where this pair cannot use it (another host, another backend)."""
        ...

    async def send(self, job: SendJob) -> pb.PullReply | None:
        """Move `job`'s KV and return the Pull's answer; the send then ends exactly once (`Sends.end`: the source
        frees or keeps the blocks), now or when its bytes are out. None: this transport does not take the pull
        (nothing done, the next one is asked). May abort the call (`job.context.abort` raises) once it ended it."""
        ...


class Offer(Protocol):
    """What a receiver set up before a Pull (a reserved region, posted receives)."""

    def answered(self, reply: pb.PullReply) -> None:
        """The reply arrived, whichever transport sends it: keep only what it uses."""
        ...

    def withdraw(self) -> bool:
        """The offer goes unused (the Pull failed, or another transport answered): undo what is left of it.
        Idempotent. True: the pair must be dropped (receives are still posted on it)."""
        ...


@dataclass
class Pull:
    """One pull on the client: the request about to go (receivers add their fields), the receiving layout."""

    request: pb.PullRequest
    layout: KVLayout
    num_tokens: int | None  # the tokens the KV covers, when known (the KV location's count)


@dataclass
class Arrival:
    """A KV on its way: `wait` (blocking: a thread runs it; None: it is here) and then `result`."""

    result: Callable[[], KVExport]
    wait: Callable[[], None] | None = None


class Receiver(Protocol):
    """A transport's client half on one pair."""

    name: str

    def prepare(self, link: Link, pull: Pull) -> Offer | None:
        """Before the Pull is sent: add this transport's fields to `pull.request`; None: nothing offered."""
        ...

    async def receive(self, link: Link, pull: Pull, reply: pb.PullReply, offer: Offer | None) -> Arrival | None:
        """The KV the reply announces, if it is this transport's (None: another's); `offer` is what `prepare`
        returned. Raises KvTransferError for a reply that does not check out."""
        ...

    def close(self) -> None:
        """The pair is forgotten: let go of this transport's state on it (mappings stay while tensors use them)."""
        ...


@dataclass(frozen=True)
class Transport:
    """One KV transport: its name (stats, docs, tests) and how each side makes its half."""

    name: str
    server: Callable[[Sends], Sender | None]  # None: this server does not offer it (e.g. no shared memory)
    # None: the pair was not offered it, or cannot take it. Runs on the loop when the Connect reply is in, before the
    # pair's group forms (what the server offers, e.g. a segment's name, may be gone once it has).
    connect: Callable[[Receives, pb.ConnectReply, KVLayout], Receiver | None]
