"""Held KV across a prefill group's ranks (KvHandOff over RankKv pool slices, in-process): each rank serves its
heads, the leader frees once every send ended."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.held import Freed, KvHandOff
from shared.kv.rank_held import HeldTable, RankKv
from shared.sharding.layout import kv_head_range

KVH, TP = 4, 2


def sync(test):
    """Run an async test on a fresh loop (the project has no async pytest plugin)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


class Group:
    """Two ranks' RankKv wired to one KvHandOff in-process (the agents' calls, without processes)."""

    def __init__(self, lease_s: float = 60.0) -> None:
        self.released: list[str] = []
        self.ranks: list[RankKv] = []
        self.pools: list[KVPool] = []
        for rank in range(TP):
            layout = KVLayout(2, KVH, 3, 4, "float32", tuple(kv_head_range(KVH, TP, rank)))
            pool = KVPool(layout, 8)
            pool.tensor.copy_(torch.randn(pool.tensor.shape))
            self.pools.append(pool)
            self.ranks.append(RankKv(rank, pool=pool))
        self.leader = KvHandOff(self.ranks, self._release, lease_s)
        for r in self.ranks:
            r.report_to(self.leader)

    async def hold(self, key: str, block_ids: list[int], num_tokens: int) -> bool:
        return await self.leader.hold(key, key, 0, table=HeldTable(block_ids, num_tokens))

    async def cancel(self, key: str) -> None:
        await self.leader.release(key)

    async def _release(self, key: str) -> None:
        assert all(key not in r.held() for r in self.ranks), "freed while a rank still serves it"
        self.released.append(key)


@sync
async def test_freed_after_every_pull_of_the_group() -> None:
    g = Group()
    await g.hold("k", [5, 2], 7)
    assert all(r.held() == ["k"] for r in g.ranks)
    kv = await g.ranks[1].begin_send_heads("k", range(3, 4), group_pulls=2)
    pool = g.pools[1].tensor
    assert torch.equal(kv.blocks, pool[:, :, [5, 2], :, 1:2]) and kv.blocks.is_contiguous()
    assert kv.layout.kv_heads == (3,) and kv.num_tokens == 7
    await g.ranks[1].end_send("k", ok=True)
    assert g.released == []  # one of the group's two pulls
    await g.ranks[0].begin_send_heads("k", range(0, 2), group_pulls=2)
    await g.ranks[0].end_send("k", ok=True)
    assert g.released == ["k"] and g.leader.freed[Freed.PULLED] == 1 and g.leader.count() == 0
    with pytest.raises(KeyError):
        await g.ranks[0].begin_send_heads("k", range(0, 2), 2)


@sync
async def test_heads_a_rank_does_not_hold_are_refused() -> None:
    g = Group()
    await g.hold("k", [0], 1)
    with pytest.raises(ValueError, match="holds KV heads \\[0, 1\\]"):
        await g.ranks[0].begin_send_heads("k", range(1, 3), 1)
    with pytest.raises(KeyError):
        await g.ranks[0].begin_send_heads("other", range(0, 1), 1)


@sync
async def test_a_failed_send_frees_after_the_other_ranks_sends_end() -> None:
    g = Group()
    await g.hold("k", [1], 3)
    await g.ranks[0].begin_send_heads("k", range(0, 2), 2)
    await g.ranks[1].begin_send_heads("k", range(2, 4), 2)
    failing = asyncio.create_task(g.ranks[1].end_send("k", ok=False))
    await asyncio.sleep(0.05)
    assert g.released == []  # rank 0 is still sending: the free waits for it (not its caller: no call does)
    with pytest.raises(KeyError):  # but no new pull of the key starts anywhere
        await g.ranks[1].begin_send_heads("k", range(2, 4), 2)
    await g.ranks[0].end_send("k", ok=True)
    await failing
    assert g.released == ["k"] and g.leader.freed == {Freed.SEND_FAILED: 1}


@sync
async def test_lease_expiry_mid_send_waits_for_the_send() -> None:
    g = Group(lease_s=0.05)
    await g.hold("k", [1], 3)
    await g.ranks[0].begin_send_heads("k", range(0, 2), 2)
    await asyncio.sleep(0.2)
    assert g.released == []  # expired, but rank 0's send owns the blocks
    await g.ranks[0].end_send("k", ok=True)
    await asyncio.sleep(0.01)
    assert g.released == ["k"] and g.leader.freed == {Freed.LEASE_EXPIRED: 1}


@sync
async def test_lease_expiry_without_pulls_and_cancel() -> None:
    g = Group(lease_s=0.05)
    await g.hold("a", [1], 3)
    await asyncio.sleep(0.15)
    assert g.released == ["a"]
    await g.hold("b", [2], 3)
    await g.cancel("b")
    await g.cancel("b")  # once
    assert g.released == ["a", "b"] and g.leader.freed == {Freed.LEASE_EXPIRED: 1, Freed.CANCELLED: 1}


@sync
async def test_cancel_mid_send_and_release_all() -> None:
    g = Group()
    await g.hold("k", [1], 3)
    await g.hold("j", [2], 3)
    await g.ranks[1].begin_send_heads("k", range(2, 4), 1)
    cancel = asyncio.create_task(g.cancel("k"))
    await asyncio.sleep(0.05)
    assert g.released == []  # the free waits for the send (the cancel returns: no call waits for a send)
    await g.ranks[1].end_send("k", ok=True)  # the report arrives while freeing: counted once
    await cancel
    await g.leader.release_all()
    assert sorted(g.released) == ["j", "k"] and g.leader.freed == {Freed.CANCELLED: 1, Freed.SHUTDOWN: 1}


@sync
async def test_a_rank_that_cannot_hold_frees_the_key() -> None:
    g = Group()

    async def broken(key: str, table: HeldTable | None = None) -> None:
        raise ConnectionError("rank gone")

    g.ranks[1].hold = broken  # type: ignore[method-assign]
    assert not await g.hold("k", [1], 3)
    assert g.released == ["k"] and g.leader.freed == {Freed.NOT_RECORDED: 1}
