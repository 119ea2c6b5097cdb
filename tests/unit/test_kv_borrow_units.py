"""The pieces of the same-host borrow (shared/kv/transfer/borrow.py), each alone: the pool in a memfd and its
read-only mapping from another process, the borrowed KV's copy and checks, and the server's loans on one
connection (ended by a release, or by the connection's end, which the borrower must see before any block is
freed)."""

from __future__ import annotations

import asyncio
import gc
import mmap
import multiprocessing as mp
import os
import select
import socket
from pathlib import Path

import pytest
import torch

from shared.engine.borrowed_kv import BorrowedKv, BorrowRevoked, copy_blocks
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.shared_pool import HEADER_BYTES, PoolHandle, SharedPoolMemory, attach_pool
from shared.kv.transfer.borrow import Lender, pool_handle, pool_memory

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")


def _shared_pool(num_blocks: int = 12) -> KVPool:
    pool = KVPool(LAYOUT, num_blocks, shared=True)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def _read_in_child(handle: PoolHandle, shape, out) -> None:
    try:
        out.send(attach_pool(handle, shape, torch.float32).numpy().copy())  # not a tensor: torch would send an fd
    except Exception as e:  # sent back for the test to see
        out.send(e)


def test_a_shared_pool_is_zeroed_and_another_process_reads_it_in_place():
    assert torch.count_nonzero(KVPool(LAYOUT, 4, shared=True).tensor) == 0  # as torch.zeros
    pool = _shared_pool()
    handle = pool.handle()
    assert handle is not None and handle.pid == os.getpid() and handle.num_blocks == 12
    assert KVPool(LAYOUT, 4).handle() is None  # a private pool is never offered
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_read_in_child, args=(handle, tuple(pool.tensor.shape), theirs))
    child.start()
    got = ours.recv()
    child.join(30)
    assert not isinstance(got, Exception), got
    assert torch.equal(torch.from_numpy(got), pool.tensor)


def test_attaching_refuses_what_is_not_the_pool_announced():
    pool = _shared_pool()
    handle = pool.handle()
    assert handle is not None
    shape = tuple(pool.tensor.shape)
    view = attach_pool(handle, shape, torch.float32)
    assert torch.equal(view, pool.tensor)
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any("pdserve-kv-pool" in line and line.split()[1] == "r--s" for line in maps)  # mapped read-only
    with pytest.raises(ValueError, match="nonce"):
        attach_pool(PoolHandle(handle.pid, handle.fd, handle.nbytes, b"x" * 16, 12), shape, torch.float32)
    with pytest.raises(ValueError, match="cannot hold"):
        attach_pool(handle, (*shape[:2], 13, *shape[3:]), torch.float32)
    other = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="size differs"):  # an fd of that number that is something else
            attach_pool(PoolHandle(handle.pid, other, handle.nbytes, handle.nonce, 12), shape, torch.float32)
    finally:
        os.close(other)
    with pytest.raises(OSError):  # a process that is gone
        attach_pool(PoolHandle(2**22 + 1, handle.fd, handle.nbytes, handle.nonce, 12), shape, torch.float32)


def test_whoever_opens_the_pool_may_read_it_and_only_its_owner_writes_it():
    pool = _shared_pool()
    handle = pool.handle()
    assert handle is not None
    fd = os.open(f"/proc/self/fd/{handle.fd}", os.O_RDWR)  # a peer of the same user asking for write access
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", HEADER_BYTES)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, handle.nbytes)  # a writable shared mapping
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # would SIGBUS the owner
    finally:
        os.close(fd)
    pool.tensor[0, 0, 0].fill_(7.0)  # the owner's mapping writes on
    assert float(attach_pool(handle, tuple(pool.tensor.shape), torch.float32)[0, 0, 0, 0, 0, 0]) == 7.0


def test_a_pool_that_cannot_be_shared_is_a_private_one(monkeypatch):
    def refused(pool_bytes: int):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(SharedPoolMemory, "create", staticmethod(refused))
    pool = KVPool(LAYOUT, 4, shared=True)
    assert pool.memory is None and pool.handle() is None and torch.count_nonzero(pool.tensor) == 0
    with pytest.raises(ValueError, match="host pool"):
        KVPool(LAYOUT, 4, device="meta", shared=True)


def test_the_connect_reply_carries_the_handle_both_ways():
    handle = _shared_pool().handle()
    assert handle is not None
    message = pool_memory(handle)
    assert message.header_bytes == HEADER_BYTES and pool_handle(message) == handle
    message.header_bytes = 8192  # another version's layout
    with pytest.raises(ValueError, match="header"):
        pool_handle(message)


@pytest.mark.parametrize(
    "src, dst",
    [([3, 4, 5, 6], [0, 1, 2, 3]), ([7, 2, 9, 10], [5, 6, 7, 1]), ([11], [0]), ([], [])],
    ids=["one-run", "mixed-runs", "one-block", "empty"],
)
def test_copy_blocks_copies_each_block_to_its_place(src, dst):
    source = torch.randn(2, 2, 12, 4, 2, 4)
    out = torch.zeros(2, 2, 8, 4, 2, 4)
    copy_blocks(out, dst, source, src)
    expected = torch.zeros_like(out)
    for d, s in zip(dst, src, strict=True):
        expected[:, :, d] = source[:, :, s]
    assert torch.equal(out, expected)
    with pytest.raises(ValueError):
        copy_blocks(out, dst + [7], source, src)


def _borrowed(pool: KVPool, blocks: list[int], lent: list[bool], released: list[int]) -> BorrowedKv:
    return BorrowedKv(
        LAYOUT, len(blocks) * 4 - 1, pool.tensor, blocks,
        still_lent=lambda: lent[0], release=lambda: released.append(1),
    )  # fmt: skip


def test_a_borrowed_kv_copies_straight_into_a_pool_and_refuses_a_copy_past_its_loan():
    lender, importer = _shared_pool(), KVPool(LAYOUT, 8)
    lent, released = [True], []
    kv = _borrowed(lender, [5, 6, 2], lent, released)
    assert kv.nbytes == 3 * LAYOUT.bytes_per_block
    assert torch.equal(kv.blocks, lender.read([5, 6, 2]))  # a checked copy, for any other use
    importer.write_export([0, 1, 7], kv)
    assert torch.equal(importer.read([0, 1, 7]), lender.read([5, 6, 2]))
    smaller = KVPool(KVLayout(2, 2, 4, 2, "float32"), 16)  # another block size: re-cut through a copy
    smaller.write_export(list(range(6)), kv)
    assert torch.equal(smaller.read(list(range(6))), kv.reblock(2))
    lent[0] = False  # the lender ended the connection: what is copied now may be another request's
    with pytest.raises(BorrowRevoked):
        importer.write_export([3, 4, 5], kv)
    with pytest.raises(BorrowRevoked):
        _ = kv.blocks
    kv.release()
    kv.release()
    assert released == [1]  # once
    assert "3 blocks" in repr(kv)  # without reading them (a revoked loan would raise)


def test_a_borrowed_kv_dropped_unreleased_is_released():
    released: list[int] = []
    kv = _borrowed(_shared_pool(), [1, 2], [True], released)
    del kv
    gc.collect()
    assert released == [1]


def _hung_up(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def test_a_lender_ends_a_loan_at_its_release_and_ends_the_connection_before_it_revokes():
    ours, theirs = socket.socketpair()
    seen: list[tuple[str, bool, bool]] = []

    def ending(rid: str):
        async def end(released: bool) -> None:
            seen.append((rid, released, _hung_up(theirs)))  # could the borrower see the end by then?

        return end

    async def run():
        lender = Lender(ours, timeout_s=30)
        lender.lend("a", ending("a"))
        lender.lend("b", ending("b"))
        await lender.release("a")
        await lender.release("unknown")  # logged, ignored
        assert "b" in lender and "a" not in lender
        with pytest.raises(RuntimeError, match="already"):  # one loan per request at a time
            lender.lend("b", ending("b again"))
        await lender.revoke()
        await lender.revoke()  # idempotent
        with pytest.raises(RuntimeError):
            lender.lend("c", ending("c"))
        return lender

    lender = asyncio.run(run())
    assert seen == [("a", True, False), ("b", False, True)]
    assert lender.lent == 2 and lender.released == 1
    ours.close()
    theirs.close()


def test_a_loan_never_released_ends_its_connection_at_the_timeout():
    ours, theirs = socket.socketpair()
    seen: list[tuple[bool, bool]] = []

    async def end(released: bool) -> None:
        seen.append((released, _hung_up(theirs)))

    async def run():
        lender = Lender(ours, timeout_s=0.05)
        lender.lend("slow", end)
        await asyncio.sleep(0.3)
        return lender

    lender = asyncio.run(run())
    assert seen == [(False, True)] and lender.revoked
    ours.close()
    theirs.close()
