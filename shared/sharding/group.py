"""The process group of one worker group's ranks, and the collectives the model and the group runtime use.

Built like the KV pairs (shared/kv/transfer/pair.py): directly on a TCPStore hosted by rank 0, never through
`init_process_group`, so a process may hold a worker group and any number of KV pairs side by side. gloo
between CPU processes, NCCL between GPUs: one code path. Every collective has the group's timeout: a rank
that dies or hangs makes the others' next collective raise instead of waiting forever.

`RankGroup.single()` is the group of one rank: every collective is the identity, so layers call them
unconditionally and a single-process worker pays nothing.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# pyright: reportPrivateImportUsage=false

LEADER = 0


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet: rank 0 hosts the TCPStore at host:port."""

    host: str
    port: int
    world: int
    backend: str = "gloo"  # "gloo" or "nccl"
    timeout_s: float = 30.0  # every collective's limit, and the joins'
    prefix: str = "group"  # key prefix in the store (a store may host several groups)
    start_timeout_s: float | None = (
        None  # joining, and agreeing at start (ranks load at their own pace); None = timeout_s
    )


class RankGroup:
    """One rank's handle on its group. Collectives block (the caller's thread) and raise RuntimeError on a
    timeout or a lost peer; after that the group is unusable (gloo closes it) and the worker group exits."""

    def __init__(self, rank: int, world: int, group: Any, store: dist.Store | None = None) -> None:
        self.rank = rank
        self.world = world
        self._group = group  # ProcessGroupGloo / ProcessGroupNCCL (torch's stubs type them without collectives)
        self._store = store  # kept alive: rank 0's store is the rendezvous of every rank

    @classmethod
    def single(cls) -> RankGroup:
        return cls(0, 1, None)

    @classmethod
    def join(cls, rdv: Rendezvous, rank: int, local_host: str | None = None) -> RankGroup:
        """Join as `rank`; blocks until all `rdv.world` ranks have joined (or raises after the timeout)."""
        timeout = timedelta(seconds=rdv.timeout_s)
        start = timedelta(seconds=rdv.start_timeout_s or rdv.timeout_s)
        store = dist.TCPStore(rdv.host, rdv.port, rdv.world, is_master=rank == LEADER, timeout=start)
        prefixed = dist.PrefixStore(rdv.prefix, store)
        if rdv.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, rdv.world, options)
        else:
            options = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
            options._timeout = timeout
            gloo = dist.ProcessGroupGloo
            options._devices = [gloo.create_device(hostname=local_host) if local_host else gloo.create_default_device()]
            group = gloo(prefixed, rank, rdv.world, options)
        return cls(rank, rdv.world, group, prefixed)

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self._group is not None:
            self._group.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on all) concatenated along `dim`, in rank order."""
        if self._group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._group.allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_(self, t: torch.Tensor, src: int = LEADER) -> torch.Tensor:
        """Overwrite `t` on every rank with rank `src`'s; returns it."""
        if self._group is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self._group.broadcast([t], opts).wait()
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        """`t` to rank `dst` only (which calls `recv_` with a tensor of its shape)."""
        if self._group is not None:
            self._group.send([t.contiguous()], dst, 0).wait()

    def recv_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite `t` with what rank `src` sends this rank; returns it."""
        if self._group is not None:
            self._group.recv([t], src, 0).wait()
        return t

    def broadcast_object(self, obj: Any = None, src: int = LEADER) -> Any:
        """Rank `src`'s picklable `obj`, on every rank (two broadcasts: the length, then the bytes)."""
        if self._group is None:
            return obj
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast_(torch.tensor([len(payload)], dtype=torch.int64), src)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src else None
        if buf is None:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast_(buf, src)
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        """Rank i sends rows in_splits[j] of `inp` (in order) to rank j and receives out_splits[j] rows from
        each rank j into `out`; returns `out`."""
        if self._group is None:
            return out.copy_(inp)
        self._group.alltoall_base(out, inp.contiguous(), out_splits, in_splits, dist.AllToAllOptions()).wait()
        return out

    def agree_min(self, name: str, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory allows), on every rank.
        Through the store, under the start timeout (not a collective's): ranks reach it at their own pace
        while they load. `name` is unique per agreement."""
        if self._group is None or self._store is None:
            return value
        self._store.set(f"agree/{name}/{self.rank}", str(value))
        keys = [f"agree/{name}/{r}" for r in range(self.world)]
        self._store.wait(keys)
        return min(int(self._store.get(k)) for k in keys)

    def barrier(self) -> None:
        if self._group is not None:
            self.all_reduce_(torch.zeros(1))

    def close(self) -> None:
        self._group = None
        self._store = None
