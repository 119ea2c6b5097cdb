"""One side of the two-rank `torch.distributed` group that carries KV between a prefill worker (rank 0)
and a decode worker (rank 1).

A pair is set up once per (prefill worker, decode worker) and reused for every transfer between them. Its
group is built directly on a PrefixStore of the prefill worker's TCPStore, never through
`init_process_group`: a worker has many pairs and no global default group. A transfer moves a list of
pieces (see wire.pieces), piece i under tag first_tag + i; transfers in flight on one pair are told apart
by their tags. `send`, `recv`, `join` and `Posted.wait` block (callers run them in worker threads);
`post_send` / `post_recv` only post (gloo operations are asynchronous) and hand back the transfer to wait
for, so an event loop can start a transfer without first waking a thread: the bytes move while the waiting
thread is being scheduled, and the hop leaves the critical path (docs/journal/benchmarks.md, "Where a pull's
milliseconds go").

After a failed or timed-out operation gloo closes the connection: a pair that failed once is dropped by
both sides and a new one is negotiated. `close()` destroys the group once no transfer is in flight on it
(never under one: a gloo operation must not outlive its group), which closes its TCP connection, so the
peer's pending operations fail at once ("Connection closed by peer") instead of at their timeout.
gloo's own `abort()` / `shutdown()` do not close the connection (checked with torch 2.13).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shared.rpc import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    # What ProcessGroupGloo/NCCL derive from: a pair's group is one, not a dist.ProcessGroup (torch.distributed's
    # own `Backend` is the enum of backend names).
    from torch._C._distributed_c10d import Backend as C10dGroup

# torch.distributed re-exports its C++ stores (Store, TCPStore, PrefixStore) without marking them public.
# pyright: reportPrivateImportUsage=false

PREFILL_RANK = 0
DECODE_RANK = 1


class TransferBackend(StrEnum):
    GLOO = "gloo"  # CPU tensors over TCP
    NCCL = "nccl"  # CUDA tensors; not exercised on CPU-only machines

    @property
    def device(self) -> str:
        """Where buffers must live for this backend."""
        return "cuda" if self is TransferBackend.NCCL else "cpu"

    @property
    def tagged(self) -> bool:
        """Whether send/recv match by tag. NCCL ignores tags and matches in issue order, so the client
        runs one transfer at a time per NCCL pair."""
        return self is TransferBackend.GLOO

    @property
    def wire(self) -> pb.Backend:
        return pb.BACKEND_NCCL if self is TransferBackend.NCCL else pb.BACKEND_GLOO

    @classmethod
    def from_wire(cls, value: pb.Backend) -> TransferBackend | None:
        return {pb.BACKEND_GLOO: cls.GLOO, pb.BACKEND_NCCL: cls.NCCL}.get(value)


def check_backend(backend: TransferBackend | str) -> TransferBackend:
    """The backend named; ValueError for an unknown one, or NCCL where CUDA or NCCL is missing."""
    try:
        checked = TransferBackend(backend)
    except ValueError:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; one of {[b.value for b in TransferBackend]}"
        ) from None
    if checked is TransferBackend.NCCL and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("the nccl backend needs CUDA and a torch built with NCCL")
    return checked


def local_address_towards(host: str) -> str:
    """This machine's address on the interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A connection of our own to a TCPStore. Joins never share one: a store client serialises its calls,
    so a join blocked waiting for an absent peer would stall every other join on the same client."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class Pair:
    """A two-rank process group plus the rank this process holds in it."""

    def __init__(self, pair_id: str, group: C10dGroup, rank: int, backend: TransferBackend, timeout_s: float) -> None:
        self.pair_id = pair_id
        self.rank = rank
        self.backend = backend
        self.timeout_s = timeout_s
        self._group: C10dGroup | None = group  # None once closed and idle: the group is destroyed
        self._lock = threading.Lock()
        self._in_flight = 0  # transfers using the group now
        self._closing = False

    @classmethod
    def join(
        cls,
        backend: TransferBackend,
        store: dist.Store,
        pair_id: str,
        rank: int,
        timeout_s: float,
        local_host: str | None,
    ) -> Pair:
        """Build the group; blocks until the other rank joins (or raises after timeout_s). local_host: the
        address gloo listens on (None = the default interface for this machine's hostname)."""
        prefixed = dist.PrefixStore(pair_id, store)
        timeout = timedelta(seconds=timeout_s)
        if backend is TransferBackend.NCCL:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            # gloo's own options (with _devices); torch's stub declares only the generic Options
            options = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
            options._timeout = timeout
            gloo = dist.ProcessGroupGloo
            options._devices = [gloo.create_device(hostname=local_host) if local_host else gloo.create_default_device()]
            group = gloo(prefixed, rank, 2, options)
        return cls(pair_id, group, rank, backend, timeout_s)

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, pieces: Iterable[torch.Tensor], first_tag: int) -> None:
        """Send contiguous tensors to the peer, piece i with tag first_tag + i; returns when all are out.
        Each piece is posted before the next is asked for: a generator that gathers the next piece then
        overlaps its gather with the wire (pool_kv.py).
        Raises RuntimeError on timeout (timeout_s for the whole transfer), a lost peer (the pair is unusable
        afterwards) or a closed pair."""
        self.post_send(pieces, first_tag).wait()

    def recv(self, pieces: Sequence[torch.Tensor], first_tag: int) -> None:
        """Fill contiguous tensors from the peer's sends with the same tags. Raises like `send`."""
        self.post_recv(pieces, first_tag).wait()

    def post_send(self, pieces: Iterable[torch.Tensor], first_tag: int) -> Posted:
        """Post the sends of `send` and return at once (gloo posts do not block): the caller, e.g. an event
        loop, need not hop to a thread before the bytes can move. The Posted must be waited on (in a thread:
        `wait` blocks), and the pieces kept alive until it returns. Raises like `send` if posting fails."""
        return self._post(lambda group, piece, tag: group.send([piece], self.peer, tag), pieces, first_tag)

    def post_recv(self, pieces: Sequence[torch.Tensor], first_tag: int) -> Posted:
        """Post the recvs of `recv` and return at once; as `post_send`."""
        return self._post(lambda group, piece, tag: group.recv([piece], self.peer, tag), pieces, first_tag)

    def close(self) -> None:
        """No new transfer on this pair; its group goes as soon as none is in flight (now, if idle)."""
        with self._lock:
            self._closing = True
            doomed = self._detach_if_idle()
        del doomed  # the last reference, dropped outside the lock: destroys the group, closes its sockets

    def _post(self, post, pieces: Iterable[torch.Tensor], first_tag: int) -> Posted:
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            if self._closing:
                raise RuntimeError(f"pair {self.pair_id!r} is closed")
            self._in_flight += 1
        # All pieces are posted at once (gloo moves them in order) and awaited against one deadline.
        posted = Posted(self, deadline)
        try:
            for i, piece in enumerate(pieces):
                posted.pending.append(post(self._group, piece, first_tag + i))
        except BaseException:
            posted.abandon()
            raise
        return posted

    def _end_transfer(self) -> None:
        with self._lock:
            self._in_flight -= 1
            doomed = self._detach_if_idle()
        del doomed

    def _detach_if_idle(self) -> C10dGroup | None:
        """Under the lock: the group, taken off this pair, once it is closing and unused; else None."""
        if not self._closing or self._in_flight:
            return None
        group, self._group = self._group, None
        return group


class Posted:
    """The operations of one transfer, posted on a pair and not yet waited for: the transfer counts as in
    flight on the pair (close() waits for it) until `wait` returns or raises. No reference to a Work may
    outlive `wait` (not even from a traceback): a Work keeps the group's connection alive, and close() relies
    on destroying it."""

    def __init__(self, pair: Pair, deadline: float) -> None:
        self._pair = pair
        self._deadline = deadline
        self.pending: deque = deque()
        self._ended = False

    def wait(self) -> None:
        """Blocking: until every operation completed; RuntimeError on timeout, a lost peer or a closed pair."""
        if self._ended:
            raise RuntimeError("this transfer was waited for already")
        pending = self.pending
        try:
            # Last first: a pair's operations complete in posting order (one TCP connection, written and read
            # in order), so once the last is done the others are too and their waits return without sleeping.
            # Waiting first to last instead wakes this thread once per piece, and on loaded cores each wake-up
            # costs up to a scheduler slice (docs/journal/benchmarks.md, "Where a pull's milliseconds go"). Every
            # operation is still waited for, so nothing depends on that order being kept.
            while pending:
                pending.pop().wait(timedelta(seconds=max(self._deadline - time.monotonic(), 0.001)))
        except BaseException:
            _settle(pending)
            raise
        finally:
            self.abandon()

    def forsake(self) -> None:
        """End the transfer without waiting for its operations (receives posted before a Pull whose sender
        will never fill them: posted.py). Their Work objects are dropped at once, pending; the caller must
        close the pair afterwards: gloo's connection still lists those receives."""
        if self._ended:
            return
        self._ended = True
        self.pending.clear()
        self._pair._end_transfer()

    def abandon(self) -> None:
        """Settle what is still pending (after a failure: gloo fails the rest at once) and end the transfer."""
        if self._ended:
            return
        self._ended = True
        _settle(self.pending)
        self.pending.clear()
        self._pair._end_transfer()


def _settle(works: deque) -> None:
    """Wait out the operations still pending after one failed. gloo closed the pair on that failure, so
    they fail at once; none may be left pending when its buffer (or the group) goes away."""
    for work in works:
        try:
            work.wait(timedelta(milliseconds=1))
        except Exception:
            pass
