"""Head-slice Pulls: the request fields, the sources that may serve them, and the rank transfer ids."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.endpoints import group_of, rank_worker_id
from shared.kv.transfer.heads import HeadsRefused, begin_send, head_fields
from shared.rpc import kv_transfer_pb2 as pb

LAYOUT = KVLayout(2, 4, 8, 4, "float32")


class WholeSource:
    """A single worker's source: whole-KV pulls only."""

    layout = LAYOUT

    def is_sending(self, key: str, /) -> bool:
        return False

    async def begin_send(self, key: str, /) -> KVExport:
        return KVExport(LAYOUT, 1, torch.zeros(2, 2, 1, 4, 4, 8))

    async def end_send(self, key: str, /, ok: bool) -> None:
        return None


def test_head_fields() -> None:
    assert head_fields(LAYOUT, 0) == {}  # whole KV: the Pull is exactly the single-worker one
    assert head_fields(KVLayout(2, 4, 8, 4, "float32", (2, 3)), 2) == {
        "kv_head_start": 2,
        "kv_head_count": 2,
        "group_pulls": 2,
    }
    with pytest.raises(ValueError, match="contiguous"):
        head_fields(KVLayout(2, 4, 8, 4, "float32", (0, 2)), 1)
    with pytest.raises(ValueError, match="group_pulls"):
        head_fields(KVLayout(2, 4, 8, 4, "float32", (1,)), 0)


def test_a_whole_kv_source_refuses_head_slices() -> None:
    source = WholeSource()
    whole = asyncio.run(begin_send(source, "r", pb.PullRequest(request_id="r")))
    assert whole.blocks.shape[4] == 4
    with pytest.raises(HeadsRefused, match="whole-KV pulls only"):
        asyncio.run(begin_send(source, "r", pb.PullRequest(request_id="r", kv_head_start=0, kv_head_count=1)))


def test_rank_ids() -> None:
    assert rank_worker_id("decode-a", 3) == "decode-a#r3"
    assert group_of("decode-a#r3") == "decode-a"
    assert group_of("decode-a") == "decode-a"  # a single worker is its own group
    assert group_of("#r1") == "#r1" and group_of("x#rz") == "x#rz"
