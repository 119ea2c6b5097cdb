"""A single prefill worker's HeldKv serving a decode group's ranks their KV heads (TP 1 → TP 2): slice sends
of one key run side by side, from one export; the blocks are freed once the group's pulls all ended well, or
once the sends in flight ended after a failed one; a whole-KV pull cannot overlap them."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.held import Freed, HeldKv, HeldState
from shared.kv.transfer.source import AlreadySending

LAYOUT = KVLayout(2, 4, 3, 4, "float32")


class Blocks:
    """The engine side: one request's KV as a real export; exports and releases counted."""

    layout = LAYOUT

    def __init__(self) -> None:
        self.full = KVExport(LAYOUT, 7, torch.randn(2, 2, 2, 4, 4, 3))
        self.exports: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        self.gate = asyncio.Event()
        self.gate.set()

    async def export_kv(self, request_id: str) -> KVExport:
        self.exports[request_id] += 1
        await self.gate.wait()
        return self.full

    async def release_kv(self, request_id: str) -> None:
        self.releases[request_id] += 1


def _run(test) -> None:
    asyncio.run(test())


def test_every_rank_gets_its_heads_from_one_export_and_the_kv_is_freed_after_the_last() -> None:
    async def test() -> None:
        blocks = Blocks()
        held = HeldKv(blocks, 60.0)
        await held.hold("k", "r", 0)
        blocks.gate.clear()  # both ranks' pulls arrive while the export is still running
        first = asyncio.create_task(held.begin_send_heads("k", range(0, 2), 2))
        second = asyncio.create_task(held.begin_send_heads("k", range(2, 4), 2))
        await asyncio.sleep(0)
        blocks.gate.set()
        a, b = await first, await second
        assert blocks.exports["k"] == 1
        assert a.layout.kv_heads == (0, 1) and b.layout.kv_heads == (2, 3) and a.num_tokens == 7
        assert torch.equal(torch.cat([a.blocks, b.blocks], dim=4), blocks.full.blocks) and b.blocks.is_contiguous()
        assert not held.is_sending("k")  # slices may overlap: the server's whole-send check lets the next one in
        with pytest.raises(AlreadySending):
            await held.begin_send("k")  # but not a whole-KV pull
        await held.end_send("k", ok=True)
        assert held.state("k") is HeldState.SENDING and not blocks.releases
        await held.end_send("k", ok=True)
        assert held.state("k") is HeldState.FREED and blocks.releases == {"k": 1} and held.freed == {Freed.PULLED: 1}

    _run(test)


def test_between_slices_the_kv_is_held_again_and_a_failed_slice_frees_it_after_the_others() -> None:
    async def test() -> None:
        blocks = Blocks()
        held = HeldKv(blocks, 60.0)
        await held.hold("k", "r", 0)
        await held.begin_send_heads("k", range(0, 1), 2)  # tiny_mqa-like: each decode rank takes a replica
        await held.end_send("k", ok=True)
        assert held.state("k") is HeldState.HELD and not blocks.releases  # one of two: wait for the other rank
        await held.begin_send_heads("k", range(0, 1), 3)
        await held.begin_send_heads("k", range(1, 2), 3)
        await held.end_send("k", ok=False)
        assert not blocks.releases  # a send of the key is still in flight: its blocks are not freed under it
        with pytest.raises(KeyError):
            await held.begin_send_heads("k", range(2, 3), 3)  # doomed: no new slice
        await held.end_send("k", ok=True)
        assert blocks.releases == {"k": 1} and held.freed == {Freed.SEND_FAILED: 1}
        await held.hold("x", "rx", 0)
        with pytest.raises(ValueError):
            await held.begin_send_heads("x", range(3, 5), 1)  # past the model's heads
        assert held.state("x") is HeldState.HELD  # a refused slice leaves the KV held

    _run(test)


def test_a_cancel_during_slice_sends_frees_when_they_end() -> None:
    async def test() -> None:
        blocks = Blocks()
        held = HeldKv(blocks, 60.0)
        await held.hold("k", "r", 0)
        await held.begin_send_heads("k", range(0, 2), 2)
        await held.release("k")
        assert not blocks.releases
        await held.end_send("k", ok=True)
        assert blocks.releases == {"k": 1} and held.freed == {Freed.CANCELLED: 1}

    _run(test)
