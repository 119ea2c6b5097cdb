"""Pair.post_send / post_recv: a transfer posted without blocking and waited for later, on a real two-rank
gloo group in this process (both ranks, each joined from its own thread)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shared.kv.transfer.loop_send import loop_pieces
from shared.kv.transfer.pair import DECODE_RANK, PREFILL_RANK, Pair, TransferBackend

# pyright: reportPrivateImportUsage=false
HOST = "127.0.0.1"


@pytest.fixture
def pairs():
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    joined: dict[int, Pair] = {}

    def join(rank: int) -> None:
        client = dist.TCPStore(HOST, store.port, is_master=False, timeout=timedelta(seconds=20))
        joined[rank] = Pair.join(TransferBackend.GLOO, client, "posting", rank, 20.0, HOST)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (PREFILL_RANK, DECODE_RANK)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield joined[PREFILL_RANK], joined[DECODE_RANK]
    for pair in joined.values():
        pair.close()


def test_posted_pieces_arrive_whole_and_in_place(pairs):
    sender, receiver = pairs
    sent = [torch.arange(n, dtype=torch.float32) * (i + 1) for i, n in enumerate((5, 1000, 70_000))]
    got = [torch.empty_like(t) for t in sent]
    recvs = receiver.post_recv(got, 7)  # both only post: neither call blocks on the other side
    sends = sender.post_send(iter(sent), 7)
    sends.wait()
    recvs.wait()
    for a, b in zip(sent, got, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="waited for already"):
        recvs.wait()


def test_close_waits_for_a_posted_transfer_and_then_refuses_new_ones(pairs):
    sender, receiver = pairs
    payload, out = torch.randn(4096), torch.empty(4096)
    recvs = receiver.post_recv([out], 3)
    receiver.close()  # a transfer is in flight: the group stays until its wait returns
    sender.send([payload], 3)
    recvs.wait()
    assert torch.equal(payload, out)
    with pytest.raises(RuntimeError, match="closed"):
        receiver.post_recv([out], 4)


def test_a_wait_that_times_out_fails_and_ends_the_transfer(pairs):
    _, receiver = pairs
    receiver.timeout_s = 0.2
    recvs = receiver.post_recv([torch.empty(8)], 9)  # nothing is ever sent under tag 9
    with pytest.raises(RuntimeError):
        recvs.wait()
    receiver.close()  # no transfer counts as in flight any more: the group goes now
    assert receiver._group is None


def test_only_cheap_host_sends_are_posted_from_the_loop():
    from shared.engine.kv_export import KVExport
    from shared.engine.kv_pool import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32")
    kv = KVExport(layout, 2, torch.zeros(1, 2, 1, 2, 1, 4))
    assert loop_pieces(kv, TransferBackend.GLOO, 0) is not None
    assert loop_pieces(kv, TransferBackend.NCCL, 0) is None
