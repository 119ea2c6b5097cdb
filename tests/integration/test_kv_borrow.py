"""Same host, one copy: a decode client borrows a request's blocks in the prefill process's shared pool.

The prefill process (test_kv_transfer.py's, its pool in a memfd) lends; this process maps the pool, imports the
borrowed blocks straight into its own engine's pool and releases them. Checked: the bytes and the decode are
exact, the prefill keeps the blocks until the release and frees them after it, a loan dropped unreleased or cut
by its connection's end is freed, a copy made after the loan ended is refused (BorrowRevoked: the caller
recomputes), and a prefill process killed while lending fails the import, not the decode worker.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from shared.engine.borrowed_kv import BorrowedKv, BorrowRevoked
from shared.engine.sampling import SamplingParams
from shared.kv.transfer import KvTransferClient
from tests.integration.test_kv_transfer import (
    SECRET,
    TIMEOUT_S,
    PrefillProcess,
    _engine,
    _generated,
    _prefill_main,
    _prompt,
    _run,
)


def _start(checkpoint) -> tuple[mp.Process, PrefillProcess]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint), {"shared_pool": True}), daemon=True)
    proc.start()
    if not ours.poll(60):
        proc.kill()
        raise RuntimeError(f"the prefill process did not start (exit code {proc.exitcode})")
    return proc, PrefillProcess(proc, ours, ours.recv())


@pytest.fixture(scope="module")
def lender(checkpoint):
    proc, process = _start(checkpoint)
    try:
        yield process
        process.conn.send(("stop",))
        proc.join(15)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _pool_maps() -> list[str]:
    """Prefill pools and segments this process still maps."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "pdserve-kv" in line]


def _client(worker: str, borrow: bool = True) -> KvTransferClient:
    return KvTransferClient(worker, secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=True, borrow=borrow)


@pytest.mark.parametrize("scatter", [False, True], ids=["one-run", "scattered"])
@pytest.mark.parametrize("block_size", [16, 8], ids=["same-blocks", "re-cut"])
def test_a_borrowed_pull_is_imported_exactly_and_freed_at_its_release(lender, checkpoint, model, scatter, block_size):
    prompt = _prompt(150, seed=71)  # 10 blocks of 16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _generated(checkpoint, model, prompt, params)

    rid = f"borrow-{scatter}-{block_size}"
    first = lender.prefill(rid, prompt, scatter=scatter)
    sent = lender.call("export", rid)
    before = lender.call("state")
    decode = _engine(checkpoint, model, block_size=block_size, num_kv_blocks=96)

    async def run():
        client = _client(f"decode-{rid}")
        try:
            kv = await client.pull(lender.address, rid, decode.layout)
            assert isinstance(kv, BorrowedKv)
            lent = await asyncio.to_thread(lender.call, "state")
            assert torch.equal(kv.blocks, sent)  # a gathered copy of exactly the pool's bytes
            decode.import_kv(rid, prompt, first, params, kv)
            client.recycle(kv)  # the release
            released = await asyncio.to_thread(lender.settled_state)
            return lent, released, client.stats
        finally:
            await client.close()

    lent, released, stats = asyncio.run(run())
    assert lent["sending"] == [rid]  # held while lent
    assert stats.borrowed_pulls == 1 and stats.shm_pulls == 0 and stats.local_pulls == 1
    assert first + _run(decode) == expected
    decode.check_integrity()
    assert released["held"] == [] and released["integrity"] is None and released["free"] == released["total"]
    assert released["borrowed_pulls"] - before["borrowed_pulls"] == 1
    assert released["failed_sends"] == before["failed_sends"]  # a release is a send that went well


def test_without_borrowing_the_same_host_pull_goes_through_the_segment(lender, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    lender.prefill("no-borrow", _prompt(70, seed=72))
    sent = lender.call("export", "no-borrow")

    async def run():
        client = _client("decode-no-borrow", borrow=False)
        try:
            kv = await client.pull(lender.address, "no-borrow", layout)
            return torch.equal(kv.blocks, sent), type(kv), client.stats
        finally:
            await client.close()

    same, kind, stats = asyncio.run(run())
    assert same and kind is not BorrowedKv and stats.shm_pulls == 1 and stats.borrowed_pulls == 0
    lender.assert_all_free()


def test_a_loan_dropped_unreleased_is_given_back(lender, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    lender.prefill("dropped", _prompt(70, seed=73))

    async def run():
        client = _client("decode-dropped")
        try:
            kv = await client.pull(lender.address, "dropped", layout)
            assert isinstance(kv, BorrowedKv)
            del kv  # a failed import drops it: the finalizer releases
            gc.collect()
            state = await asyncio.to_thread(lender.settled_state)
            return state, client.stats
        finally:
            await client.close()

    state, stats = asyncio.run(run())
    assert stats.borrowed_pulls == 1 and state["held"] == [] and state["free"] == state["total"]


def test_a_loan_cut_by_its_connection_is_freed_and_its_copy_refused(lender, checkpoint, model):
    """The client drops its pair (as after a failure) while holding a loan: the prefill frees the blocks, and an
    import made after that refuses the copy rather than decode from blocks that may be reused."""
    prompt = _prompt(70, seed=74)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = lender.prefill("cut", prompt)
    failed_before = lender.call("state")["failed_sends"]
    decode = _engine(checkpoint, model)

    async def run():
        client = _client("decode-cut")
        kv = await client.pull(lender.address, "cut", decode.layout)
        await client.close()  # ends the Unix socket connection the loan came over
        state = await asyncio.to_thread(lender.settled_state)
        return kv, state

    kv, state = asyncio.run(run())
    assert state["held"] == [] and state["free"] == state["total"]
    assert state["failed_sends"] - failed_before == 1  # revoked, counted as a failed send
    free_before = decode.blocks.num_free
    with pytest.raises(BorrowRevoked):
        decode.import_kv("cut", prompt, first, params, kv)
    assert "cut" not in decode.requests and decode.blocks.num_free == free_before  # nothing kept
    decode.check_integrity()


def test_a_prefill_process_killed_while_lending(checkpoint, model):
    """The lender dies with a loan out: the mapping stays valid (the memfd lives while mapped), the connection is
    gone, so the import refuses the copy and the caller recomputes; nothing is left behind."""
    proc, victim = _start(checkpoint)
    try:
        prompt = _prompt(70, seed=75)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        first = victim.prefill("orphan", prompt)
        decode = _engine(checkpoint, model)

        async def run():
            client = _client("decode-orphaned")
            try:
                kv = await client.pull(victim.address, "orphan", decode.layout)
                proc.kill()
                await asyncio.to_thread(proc.join, 10)
                await asyncio.sleep(0.05)
                with pytest.raises(BorrowRevoked):
                    decode.import_kv("orphan", prompt, first, params, kv)
                client.recycle(kv)  # a release to nobody: nothing happens
                del kv
                for _ in range(100):  # the stream's end is seen on the loop: the pair is forgotten, its maps go
                    if client.shm_free_bytes(victim.address) is None:
                        break
                    await asyncio.sleep(0.02)
                gc.collect()
                return client.stats, client.shm_free_bytes(victim.address), _pool_maps()
            finally:
                await client.close()

        stats, segment, maps = asyncio.run(run())
        assert stats.borrowed_pulls == 1 and not proc.is_alive()
        assert segment is None and maps == []  # the dead worker's pool and segment unmapped, no pull needed
        decode.check_integrity()
        assert decode.blocks.num_free == decode.blocks.num_blocks
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
