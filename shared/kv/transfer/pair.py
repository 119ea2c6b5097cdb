"""One side of the two-rank `torch.distributed` group that carries KV between a prefill worker (rank 0)
and a decode worker (rank 1).

A pair is set up once per (prefill worker, decode worker) and reused for every transfer between them. Its
group is built directly on a PrefixStore of the prefill worker's TCPStore, never through
`init_process_group`: a worker has many pairs and no global default group. Transfers in flight on one
pair are told apart by tag. Every method here blocks; callers run them in worker threads.

After a failed or timed-out operation gloo closes the connection: a pair that failed once is dropped by
both sides and a new one is negotiated.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist

from shared.rpc import kv_transfer_pb2 as pb

PREFILL_RANK = 0
DECODE_RANK = 1


class Backend(StrEnum):
    GLOO = "gloo"  # CPU tensors over TCP
    NCCL = "nccl"  # CUDA tensors; not exercised on CPU-only machines

    @property
    def device(self) -> str:
        """Where buffers must live for this backend."""
        return "cuda" if self is Backend.NCCL else "cpu"

    @property
    def tagged(self) -> bool:
        """Whether send/recv match by tag. NCCL ignores tags and matches in issue order, so the client
        runs one transfer at a time per NCCL pair."""
        return self is Backend.GLOO

    @property
    def wire(self) -> pb.Backend.ValueType:
        return pb.BACKEND_NCCL if self is Backend.NCCL else pb.BACKEND_GLOO

    @classmethod
    def from_wire(cls, value: pb.Backend.ValueType) -> Backend | None:
        return {pb.BACKEND_GLOO: cls.GLOO, pb.BACKEND_NCCL: cls.NCCL}.get(value)


def check_backend(backend: Backend | str) -> Backend:
    """The backend named; ValueError for an unknown one, or NCCL where CUDA or NCCL is missing."""
    try:
        checked = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown KV transfer backend {backend!r}; one of {[b.value for b in Backend]}") from None
    if checked is Backend.NCCL and not (torch.cuda.is_available() and dist.is_nccl_available()):
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

    def __init__(self, pair_id: str, group: dist.ProcessGroup, rank: int, backend: Backend, timeout_s: float) -> None:
        self.pair_id = pair_id
        self.group = group
        self.rank = rank
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)

    @classmethod
    def join(
        cls, backend: Backend, store: dist.Store, pair_id: str, rank: int, timeout_s: float, local_host: str | None
    ) -> Pair:
        """Build the group; blocks until the other rank joins (or raises after timeout_s). local_host: the
        address gloo listens on (None = the default interface for this machine's hostname)."""
        prefixed = dist.PrefixStore(pair_id, store)
        timeout = timedelta(seconds=timeout_s)
        if backend is Backend.NCCL:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            gloo = dist.ProcessGroupGloo
            options._devices = [gloo.create_device(hostname=local_host) if local_host else gloo.create_default_device()]
            group = gloo(prefixed, rank, 2, options)
        return cls(pair_id, group, rank, backend, timeout_s)

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Send a contiguous tensor to the peer; returns when it is out. Raises RuntimeError on timeout or
        a lost peer (the pair is unusable afterwards)."""
        self.group.send([tensor], self.peer, tag).wait(self.timeout)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        """Fill a contiguous tensor from the peer's send with the same tag. Raises like `send`."""
        self.group.recv([tensor], self.peer, tag).wait(self.timeout)
