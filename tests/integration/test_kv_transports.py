"""Transport conformance: the same pull scenarios through every registered KV transport (transports/registry.py).

Each test runs a server and a client in this process over a bare KV pool (no model: seconds, not an engine
build), the server offering only the transport under test (and the plain pair, the fallback every pair has),
and checks the transport took the pull on both sides. A source that counts its sends stands in for HeldKv: every
`begin_send` must end exactly once (`end_send`), whatever happened. A new transport gets these tests by
registering itself, plus a line in `SETUPS` saying how to make it take a pull and how to break one of its sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import torch

from shared.engine.borrowed_kv import BorrowedKv
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.layer_streams import LayerProgress, StreamStart
from shared.kv.transfer import FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer.layer_stream import StreamedKv, StreamedPoolKv
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.source import AlreadySending, Outgoing
from shared.kv.transfer.transports.registry import TRANSPORTS, by_name

SECRET = b"transport-conformance-secret-0123456789"
TIMEOUT_S = 10.0
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
POOL_BLOCKS = 48
# Requests of the same size: one in a contiguous run of blocks, one scattered over the pool (both sent straight
# from the pool's runs, where a transport sends pieces), one scattered and small enough to be gathered first.
BLOCKS = {
    "contiguous": list(range(8, 20)),
    "scattered": [31, 2, 17, 40, 5, 23, 11, 44, 29, 0, 36, 14],
    "gathered": [3, 46, 21, 9, 33, 27, 1, 38, 20, 42, 6, 25],
}
NUM_TOKENS = 45  # 12 blocks of 4, the last one partly filled


def _progress_done() -> LayerProgress:
    """The progress of a prefill that wrote every layer and sampled its first token (7)."""
    progress = LayerProgress(LAYOUT.num_layers)
    for layer in range(LAYOUT.num_layers):
        progress.mark(layer)
    progress.finish(7)
    return progress


@dataclass
class CountingSource:
    """A KvSource over a bare pool that records every send's end, and fails a second end of one send."""

    pool: KVPool
    streamed: bool = False  # sends are layer streams (of a prefill that finished), as a watched request's
    held: dict[str, list[int]] = field(default_factory=lambda: dict(BLOCKS))
    sending: set[str] = field(default_factory=set)
    ends: dict[str, list[bool]] = field(default_factory=dict)  # request → the `ok` of each end_send

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def is_sending(self, request_id: str, /) -> bool:
        return request_id in self.sending

    async def begin_send(self, request_id: str, /) -> Outgoing:
        if request_id not in self.held:
            raise KeyError(f"no KV held for {request_id!r}")
        if request_id in self.sending:
            raise AlreadySending(request_id)
        self.sending.add(request_id)
        blocks = self.held[request_id]
        direct = request_id != "gathered"  # (the thresholds pick the way: pool_kv.py)
        if self.streamed:
            start = StreamStart(request_id, NUM_TOKENS, blocks, _progress_done())
            return StreamedPoolKv.of_stream(self.pool, start, _alloc, min_segment_bytes=0 if direct else 1 << 30)
        if direct:
            return PoolKv.plan(self.pool, NUM_TOKENS, blocks, _alloc, small_kv_bytes=0, min_segment_bytes=0)
        return PoolKv.plan(self.pool, NUM_TOKENS, blocks, _alloc)  # flat: under SMALL_KV_BYTES

    async def end_send(self, request_id: str, /, ok: bool) -> None:
        assert request_id in self.sending, f"{request_id!r} ended twice, or never began"
        self.sending.discard(request_id)
        self.ends.setdefault(request_id, []).append(ok)
        if ok:
            del self.held[request_id]  # sent: freed, as HeldKv frees it

    def expected(self, request_id: str) -> torch.Tensor:
        return self.pool.read(BLOCKS[request_id])


def _alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass(frozen=True)
class Setup:
    """How to make a transport take a pull: the server's and the client's options, what a pull passes."""

    server: dict = field(default_factory=dict)
    shared_pool: bool = False  # the pool in a memfd, offered to borrow
    streamed: bool = False
    num_tokens: bool = False  # the pull says its token count (receives may be posted before it)
    result: type = KVExport  # what the pulled KV is
    # Break a send of this transport: "fault" (fault_send_midway), or "revoke" (the client goes before releasing)
    breaks_by: str = "fault"


SETUPS = {
    "borrowed": Setup(shared_pool=True, result=BorrowedKv, breaks_by="revoke"),
    "segment": Setup(),
    "streamed": Setup(streamed=True, result=StreamedKv),
    "posted": Setup(num_tokens=True),
    "pair": Setup(server={"shm_bytes": 0}),
}


def test_every_registered_transport_has_a_setup():
    assert {t.name for t in TRANSPORTS} == set(SETUPS)


TRANSPORT_NAMES = pytest.mark.parametrize("name", [t.name for t in TRANSPORTS])


@dataclass
class Bench:
    source: CountingSource
    server: KvTransferServer
    address: str

    def client(self, worker: str = "decode-a") -> KvTransferClient:
        return KvTransferClient(worker, secret=SECRET, timeout_s=TIMEOUT_S)

    async def pull(self, client: KvTransferClient, request_id: str, setup: Setup):
        num_tokens = NUM_TOKENS if setup.num_tokens else None
        return await client.pull(self.address, request_id, LAYOUT, num_tokens=num_tokens)


@contextlib.asynccontextmanager
async def serving(name: str, **server_options) -> AsyncIterator[Bench]:
    setup = SETUPS[name]
    pool = KVPool(LAYOUT, POOL_BLOCKS, shared=setup.shared_pool)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(5)))
    source = CountingSource(pool, streamed=setup.streamed)
    options = {"shared_pool": pool.handle(), "chunk_bytes": 4096} | setup.server | server_options
    server = KvTransferServer("127.0.0.1", 0, source, secret=SECRET, timeout_s=TIMEOUT_S,
                              transports=by_name([name]), **options)  # fmt: skip
    address = await server.start()
    try:
        yield Bench(source, server, address)
    finally:
        await server.stop()
        if pool.memory is not None:
            del pool.tensor  # the memfd's mapping goes with the last view


def _check_taken(name: str, bench: Bench, client: KvTransferClient, pulls: int) -> None:
    assert bench.server.stats.by_transport == {name: pulls}
    assert client.stats.by_transport == {name: pulls}


@TRANSPORT_NAMES
def test_a_pull_hands_off_exact_bytes_of_contiguous_and_scattered_blocks(name):
    setup = SETUPS[name]

    async def run():
        async with serving(name) as bench:
            client = bench.client()
            try:
                for rid in BLOCKS:
                    kv = await bench.pull(client, rid, setup)
                    assert isinstance(kv, setup.result)
                    assert kv.num_tokens == NUM_TOKENS and kv.layout.block_size == LAYOUT.block_size
                    assert torch.equal(kv.blocks, bench.source.expected(rid)), rid
                    if isinstance(kv, StreamedKv):
                        assert kv.first_token == 7
                    client.recycle(kv)  # a borrowed KV is released: its send ends
                await _settled(bench)
                _check_taken(name, bench, client, len(BLOCKS))
                assert bench.source.ends == {rid: [True] for rid in BLOCKS} and not bench.source.held
            finally:
                await client.close()

    asyncio.run(run())


@TRANSPORT_NAMES
def test_a_partial_pull_carries_the_blocks_from_the_skip_on(name):
    """PullRequest.skip_tokens (skip.py): the decode side holds the first 21 tokens, so blocks 5.. move (block 5
    holds token 20). A layer stream is sent whole (first_block 0); nothing is posted for a partial pull, so the
    posted transport's pulls go over the plain pair."""
    setup = SETUPS[name]
    skip, first = 21, 5

    async def run():
        async with serving(name) as bench:
            client = bench.client()
            try:
                for rid in BLOCKS:
                    num_tokens = NUM_TOKENS if setup.num_tokens else None
                    kv = await client.pull(bench.address, rid, LAYOUT, num_tokens=num_tokens, skip_tokens=skip)
                    assert kv.num_tokens == NUM_TOKENS
                    whole = bench.source.expected(rid)
                    if setup.streamed:
                        assert kv.first_block == 0 and torch.equal(kv.blocks, whole), rid
                    else:
                        assert kv.first_block == first and torch.equal(kv.blocks, whole[:, :, first:]), rid
                    client.recycle(kv)
                await _settled(bench)
                _check_taken("pair" if name == "posted" else name, bench, client, len(BLOCKS))
                assert bench.source.ends == {rid: [True] for rid in BLOCKS} and not bench.source.held
            finally:
                await client.close()

    asyncio.run(run())


@TRANSPORT_NAMES
def test_a_refused_ticket_changes_nothing_and_the_next_pull_goes_through(name):
    setup = SETUPS[name]

    async def run():
        async with serving(name) as bench:
            client = bench.client()
            mint = client._tickets.mint
            try:
                client.recycle(await bench.pull(client, "contiguous", setup))  # forms the pair
                client._tickets.mint = lambda holder, request=None: mint(holder, "another-request")  # type: ignore[method-assign]
                with pytest.raises(KvTransferError) as refused:
                    await bench.pull(client, "scattered", setup)
                assert refused.value.reason is FailureReason.DENIED
                assert bench.source.ends.get("scattered") is None and "scattered" in bench.source.held
                client._tickets.mint = mint  # type: ignore[method-assign]
                kv = await bench.pull(client, "scattered", setup)
                assert torch.equal(kv.blocks, bench.source.expected("scattered"))
                client.recycle(kv)
                await _settled(bench)
                _check_taken(name, bench, client, 2)
                assert bench.source.ends == {"contiguous": [True], "scattered": [True]}
                assert set(bench.source.held) == {"gathered"}
            finally:
                await client.close()

    asyncio.run(run())


@TRANSPORT_NAMES
def test_a_failed_send_ends_once_and_frees_nothing_twice(name):
    setup = SETUPS[name]
    faults = {"fault_send_midway": True} if setup.breaks_by == "fault" else {}

    async def run():
        async with serving(name, **faults) as bench:
            client = bench.client()
            try:
                if setup.breaks_by == "fault":
                    with pytest.raises(KvTransferError):
                        await bench.pull(client, "scattered", setup)
                else:  # lent: the client goes before it releases, the server revokes the loan
                    kv = await bench.pull(client, "scattered", setup)
                    assert isinstance(kv, BorrowedKv)
                    await client.close()
                    kv.release()  # too late: ignored (the connection is over)
                await _settled(bench)
                assert bench.server.stats.by_transport == {name: 1}
                assert bench.source.ends == {"scattered": [False]} and not bench.source.sending
                assert bench.server.stats.failed_sends == 1
                assert "scattered" in bench.source.held  # kept by the source (HeldKv frees it: its call)
            finally:
                await client.close()

    asyncio.run(run())


async def _sending(bench: Bench, timeout_s: float) -> None:
    """Wait until a send is in flight (a pull reached the source), rather than a fixed time."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not bench.source.sending and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


async def _settled(bench: Bench, timeout_s: float = 5.0) -> None:
    """Wait until no send is in flight (a send's end runs after the reply: its wait, a borrowed KV's release)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while bench.source.sending and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("name", [t.name for t in TRANSPORTS if SETUPS[t.name].breaks_by == "fault"])
def test_a_pull_abandoned_mid_send_ends_its_send_once(name):
    """The puller cancels its pull and goes while the send stalls midway (a lent KV's puller going away is the
    failed-send test's revoke): the send ends exactly once, however it ends (the segment's copy completes into
    memory nobody reads; a send over the pair fails with the pair)."""
    setup = SETUPS[name]

    async def run():
        async with serving(name, fault_send_stall_s=1.0) as bench:
            client = bench.client()
            try:
                pulling = asyncio.create_task(bench.pull(client, "scattered", setup))
                await _sending(bench, timeout_s=TIMEOUT_S)  # the send began (a loaded host may take its time)
                await asyncio.sleep(0.1)  # and is stalled midway (the fault holds it 1 s)
                pulling.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pulling
            finally:
                await client.close()
            await _settled(bench, timeout_s=TIMEOUT_S)
            assert bench.server.stats.by_transport == {name: 1}
            assert len(bench.source.ends["scattered"]) == 1 and not bench.source.sending

    asyncio.run(run())
