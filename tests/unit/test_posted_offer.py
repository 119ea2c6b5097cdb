"""When a pull posts its receives before the Pull: never when the KV is meant to arrive another way.

Receives left posted on a pair can only be withdrawn by dropping the pair (gloo lists them until it is gone), and
dropping a same-host pair unmaps the borrowed pool under every loan in flight on it: so a pull that asks to borrow
(or offers a shared region) posts nothing. The posted transport's own path is covered by test_kv_posted.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.transports.base import Pull
from shared.kv.transfer.transports.posted_pair import PostedReceiver
from shared.rpc import kv_transfer_pb2 as pb

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


class Posting(Exception):
    """Raised where the receiver starts to post: it got past every reason not to."""


def _receiver() -> PostedReceiver:
    def take(shape, dtype):
        raise Posting

    return PostedReceiver(SimpleNamespace(buffers=SimpleNamespace(take=take)), block_size=4, chunk_bytes=1 << 20)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields", [{"borrow": True}, {"shm_offset": 0, "shm_capacity": 1 << 20}], ids=["borrowed", "shared-region"]
)
def test_a_pull_meant_to_arrive_another_way_posts_no_receives(fields) -> None:
    pull = Pull(pb.PullRequest(request_id="r", **fields), LAYOUT, num_tokens=9)
    assert _receiver().prepare(SimpleNamespace(), pull) is None  # type: ignore[arg-type]
    assert not pull.request.HasField("posted")


def test_a_plain_pull_of_known_length_posts() -> None:
    with pytest.raises(Posting):
        _receiver().prepare(SimpleNamespace(), Pull(pb.PullRequest(request_id="r"), LAYOUT, num_tokens=9))  # type: ignore[arg-type]
