"""The one KV hand-off, run for a worker of one rank and a group of two through the same scenario.

R = 1 is a single prefill worker (`HeldKv`: its rank in-process, sending from the engine side, a whole-KV pull);
R = 2 is a TP 2 group (`KvHandOff` over two `RankKv` pool slices, each serving its KV heads: a single decode
worker's plan pulls each rank's heads). The pulls go through each rank's `KvSource` calls exactly as its transfer
server makes them. Each scenario checks the state, the blocks freed exactly once (the leader's block manager, its
`check_integrity` after every scenario), the Redis entry, and why the KV was freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.held import Freed, HeldKv, HeldState, KvHandOff
from shared.kv.rank_held import HeldTable, RankKv
from shared.kv.registry import KvLocation
from shared.kv.reslice import group_pulls, plan_pulls
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.source import AlreadySending
from shared.messages import Cancel
from shared.sharding.layout import kv_head_range
from tests.kv_locations import Registry

KVH, BLOCKS, BLOCK_SIZE, TOKENS = 4, 16, 4, 10
MODEL = KVLayout(2, KVH, 3, BLOCK_SIZE, "float32")
LONG_S = 60.0


class Worker:
    """A prefill worker of `r` ranks: the leader's block manager, every rank's pool (its KV heads, the same
    random model KV), the hand-off. R = 1: the engine side is a KvBlocks over the one pool."""

    def __init__(self, r: int, lease_s: float = LONG_S) -> None:
        self.r = r
        self.blocks = BlockManager(BLOCKS, BLOCK_SIZE)
        self.full = torch.randn(2, 2, BLOCKS, BLOCK_SIZE, KVH, 3)  # (L, K|V, N, B, all heads, hd)
        self.registry = Registry()
        self.tables: dict[str, list[int]] = {}  # key → its blocks (the leader's engine)
        self.released: Counter[str] = Counter()
        if r == 1:
            self.pool = self._pool(MODEL)
            one = HeldKv(self, lease_s, self.registry)  # self: the engine side (KvBlocks)
            self.handoff: KvHandOff = one
            self.ranks: list[RankKv] = [one.rank]
        else:
            self.ranks = []
            for rank in range(r):
                heads = tuple(kv_head_range(KVH, r, rank))
                self.ranks.append(RankKv(rank, pool=self._pool(dataclasses.replace(MODEL, kv_heads=heads))))
            self.handoff = KvHandOff(self.ranks, self.release_kv, lease_s, self.registry)
            for rank_kv in self.ranks:
                rank_kv.report_to(self.handoff)

    def _pool(self, layout: KVLayout) -> KVPool:
        pool = KVPool(layout, BLOCKS)
        heads = layout.held_kv_heads
        pool.tensor.copy_(self.full[:, :, :, :, heads[0] : heads[-1] + 1])
        return pool

    # ---- the engine side of a worker of one rank (KvBlocks) ----

    @property
    def layout(self) -> KVLayout:
        return MODEL

    async def export_kv(self, request_id: str) -> PoolKv:
        return PoolKv(MODEL, TOKENS, self.pool, self.tables[request_id], "direct")

    async def release_kv(self, request_id: str) -> None:
        self.released[request_id] += 1
        self.blocks.free(self.tables.pop(request_id))

    # ---- the prefill worker's calls ----

    async def hold(self, key: str, request_id: str = "r", attempt: int = 0) -> bool:
        block_ids = self.tables[key] = self.blocks.allocate(-(-TOKENS // BLOCK_SIZE))
        table = None if self.r == 1 else HeldTable(block_ids, TOKENS)
        loc = KvLocation(key, "prefill", "host:1", TOKENS, MODEL.fingerprint)
        return await self.handoff.hold(key, request_id, attempt, loc, table)

    def expected(self, key: str) -> torch.Tensor:
        return self.full[:, :, self.tables[key]]

    # ---- a single decode worker's pull, as each rank's transfer server serves it ----

    async def begin_pull(self, key: str) -> list[tuple[RankKv, KVExport | PoolKv]]:
        """Start the plan's sends (one whole-KV send from a rank of one; each rank's heads from a group)."""
        if self.r == 1:
            return [(self.ranks[0], await self.ranks[0].begin_send(key))]
        total = group_pulls(KVH, self.r, 1)
        sends = []
        for pull in plan_pulls(KVH, self.r, 1, 0):
            rank = self.ranks[pull.rank]
            sends.append((rank, await rank.begin_send_heads(key, pull.heads, total)))
        return sends

    def assembled(self, sends: list[tuple[RankKv, KVExport | PoolKv]]) -> torch.Tensor:
        parts = []
        for _, kv in sends:
            if isinstance(kv, PoolKv):
                out = torch.empty(kv.shape)
                kv.copy_into(out)
                parts.append(out)
            else:
                parts.append(kv.blocks)
        return torch.cat(parts, dim=4)

    def check_freed_once(self, key: str, why: Freed) -> None:
        assert self.handoff.state(key) is HeldState.FREED and key not in self.handoff.keys()
        assert self.released[key] == 1 and key not in self.registry.entries
        assert all(key not in r.held() for r in self.ranks), "a rank still serves freed KV"
        assert self.handoff.freed[why] == 1
        self.blocks.check_integrity()
        assert self.blocks.num_free == BLOCKS


def _run(test):
    return lambda r: asyncio.run(test(Worker(r)))


RANKS = pytest.mark.parametrize("r", [1, 2], ids=["group-of-one", "group-of-two"])


@RANKS
def test_hold_pull_free(r: int) -> None:
    async def scenario(w: Worker) -> None:
        assert await w.hold("k")
        assert w.handoff.state("k") is HeldState.HELD and "k" in w.registry.entries
        sends = await w.begin_pull("k")
        assert w.handoff.state("k") is HeldState.SENDING
        assert torch.equal(w.assembled(sends), w.expected("k"))
        for rank, _ in sends:
            assert w.released["k"] == 0  # nothing freed while a send of the pull is out
            await rank.end_send("k", ok=True)
        w.check_freed_once("k", Freed.PULLED)
        with pytest.raises(KeyError):
            await w.begin_pull("k")

    _run(scenario)(r)


@RANKS
def test_lease_expiry_frees_and_a_late_pull_finds_nothing(r: int) -> None:
    async def scenario(w: Worker) -> None:
        w.handoff.lease_s = 0.05
        assert await w.hold("k")
        await asyncio.sleep(0.2)
        w.check_freed_once("k", Freed.LEASE_EXPIRED)
        with pytest.raises(KeyError):
            await w.begin_pull("k")

    _run(scenario)(r)


@RANKS
def test_cancel_mid_send_frees_when_the_sends_end(r: int) -> None:
    async def scenario(w: Worker) -> None:
        assert await w.hold("k", "req", 2)
        sends = await w.begin_pull("k")
        assert await w.handoff.cancel("req", Cancel("req", up_to_attempt=1).covers) == 0  # a later attempt
        assert await w.handoff.cancel("req", Cancel("req").covers) == 1
        assert w.handoff.state("k") is HeldState.SENDING and w.released["k"] == 0 and "k" in w.registry.entries
        with pytest.raises((KeyError, AlreadySending)):  # no new pull of a cancelled key
            await w.begin_pull("k")
        for rank, _ in sends:
            await rank.end_send("k", ok=True)
        w.check_freed_once("k", Freed.CANCELLED)

    _run(scenario)(r)


@RANKS
def test_a_failed_send_frees_once_after_the_sends_in_flight(r: int) -> None:
    async def scenario(w: Worker) -> None:
        assert await w.hold("k")
        sends = await w.begin_pull("k")
        first, *others = sends
        await first[0].end_send("k", ok=False)
        if others:  # another rank's send is in flight: the blocks stay until it ends
            assert w.released["k"] == 0 and w.handoff.state("k") is HeldState.SENDING
        for rank, _ in others:
            await rank.end_send("k", ok=True)
        w.check_freed_once("k", Freed.SEND_FAILED)
        await first[0].end_send("k", ok=True)  # a late end frees nothing twice
        assert w.released["k"] == 1

    _run(scenario)(r)


@RANKS
def test_release_all_frees_every_key_whatever_its_state(r: int) -> None:
    async def scenario(w: Worker) -> None:
        assert await w.hold("a") and await w.hold("b", "rb")
        await w.begin_pull("b")
        await w.handoff.release_all()
        assert w.released == {"a": 1, "b": 1} and w.handoff.count() == 0 and not w.registry.entries
        assert w.handoff.freed == {Freed.SHUTDOWN: 2}
        w.blocks.check_integrity()
        assert w.blocks.num_free == BLOCKS

    _run(scenario)(r)
