"""Pre-posted pulls across real processes (shared/kv/transfer/posted.py): the decode side posts its receives
before the Pull RPC and the prefill process, a spawned one as in test_kv_transfer.py, sends into them.

- every way the server can send (direct one run, direct scattered, layered, flat, in chunks) fills the
  posted receives of either cut (one run, flat) with the pool's exact bytes, and decode continues token-exact;
- a refused Pull (another request's ticket, a replayed ticket, another worker's, an unknown request)
  fails well before the pull timeout, abandons the posted receives at once (the client's pair is gone, no
  transfer in flight, nothing waiting) and leaves the KV held on the prefill side, pullable afterwards;
- a wrong token count: the server ignores the receives, the KV arrives the usual way, the pair is renewed;
- a prefill process SIGKILLed mid-send fails the pull at once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest
import torch

from shared.engine.sampling import SamplingParams
from shared.kv.transfer import FailureReason, KvTransferClient, KvTransferError, posted
from shared.kv.transfer.posted import POSTED_TAG_BASE
from shared.kv.transfer.transports.posted_pair import PostedReceiver
from tests.integration.test_kv_transfer import (
    PATHS,
    TIMEOUT_S,
    PrefillProcess,
    _client,
    _engine,
    _generated,
    _prefill_main,
    _prompt,
    _run,
    prefill,  # noqa: F401 (a fixture)
)

FAST_S = TIMEOUT_S / 10  # a refused or broken pull returns within this, not at its timeout


def _pull_posted(client: KvTransferClient, address: str, rid: str, layout, num_tokens: int):
    return client.pull(address, rid, layout, num_tokens=num_tokens)


def _assert_pair_released(client: KvTransferClient, address: str, pair) -> None:
    """The client forgot the pair, no transfer is in flight on it and its group is destroyed."""
    assert address not in client._connections
    assert pair._in_flight == 0 and pair._group is None


@pytest.mark.parametrize("cut", ["one-run", "flat"])
@pytest.mark.parametrize("path", ["direct", "direct-scattered", "layered", "flat", "chunked"])
def test_posted_pulls_hand_off_identical_bytes_and_decode_exactly(prefill, checkpoint, model, path, cut, monkeypatch):  # noqa: F811
    """Every way the server sends, into receives of either cut the decode side may post (the demo's KV is
    small: the flat cut unless the threshold is lowered)."""
    if cut == "one-run":
        monkeypatch.setattr(posted, "SMALL_KV_BYTES", 0)
    settings, scatter, _ = PATHS["direct" if path == "chunked" else path]
    if path == "chunked":
        settings = dict(settings, chunk_bytes=4096)
    prompt = _prompt(150, seed=71)  # 10 blocks of 16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _generated(checkpoint, model, prompt, params)

    rid = f"posted-{path}"
    first = prefill.prefill(rid, prompt, scatter=scatter)
    sent = prefill.call("export", rid)
    before = prefill.call("state")
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=96)  # its own block size: re-cut on import

    async def run():
        client = _client(f"decode-posted-{path}")
        try:
            kv = await _pull_posted(client, prefill.address, rid, decode.layout, len(prompt))
            return kv, client.stats
        finally:
            await client.close()

    with prefill.configured(**settings):
        kv, stats = asyncio.run(run())
    assert torch.equal(kv.blocks, sent)  # every byte, padding slots included
    assert stats.posted_pulls == 1 and stats.abandoned_posts == 0 and stats.connects == 1
    decode.import_kv(rid, prompt, first, params, kv)
    assert first + _run(decode) == expected
    decode.check_integrity()
    state = prefill.assert_all_free()
    assert state["posted_pulls"] - before["posted_pulls"] == 1
    assert state["failed_sends"] == before["failed_sends"]


def test_concurrent_posted_pulls_on_one_pair_keep_apart(prefill, checkpoint, model):  # noqa: F811
    """Two posted pulls of equal size at once: distinct tags from the decode side's range, each its own KV."""
    layout = _engine(checkpoint, model).layout
    rids = {"pc0": _prompt(64, seed=72), "pc1": _prompt(64, seed=73)}
    sent = {}
    for rid, p in rids.items():
        prefill.prefill(rid, p)
        sent[rid] = prefill.call("export", rid)

    async def run():
        client = _client("decode-posted-pair")
        try:
            kvs = await asyncio.gather(*(_pull_posted(client, prefill.address, r, layout, 64) for r in rids))
            posted = (await client._connections[prefill.address]).receiver("posted")
            assert isinstance(posted, PostedReceiver)
            return kvs, client.stats, posted.next_posted_tag
        finally:
            await client.close()

    kvs, stats, next_tag = asyncio.run(run())
    assert stats.posted_pulls == 2 and stats.connects == 1 and next_tag > POSTED_TAG_BASE
    for rid, kv in zip(rids, kvs, strict=True):
        assert torch.equal(kv.blocks, sent[rid])
    prefill.assert_all_free()


REFUSALS = {
    # how the pull ticket is spoiled → the reason the client sees
    "wrong-request": FailureReason.DENIED,
    "replayed": FailureReason.DENIED,
    "wrong-worker": FailureReason.DENIED,
    "unknown-request": FailureReason.NOT_FOUND,
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_posted_pull_fails_fast_and_frees_both_sides(prefill, checkpoint, model, refusal):  # noqa: F811
    layout = _engine(checkpoint, model).layout
    rid, warm = f"refused-{refusal}", f"refused-{refusal}-warm"
    prefill.prefill(warm, _prompt(40, seed=74))
    prefill.prefill(rid, _prompt(150, seed=75))
    sent = prefill.call("export", rid)

    async def run():
        client = _client(f"decode-refused-{refusal}")
        mint, minted, armed = client._tickets.mint, [], [False]

        def spoiled(holder, request=None):
            ticket = mint(holder, request)
            if request is None or not armed[0]:  # connect tickets, and the warm-up pull's: as minted
                minted.append(ticket)
                return ticket
            if refusal == "replayed":
                return minted[-1]  # the warm-up pull's, spent already
            if refusal == "wrong-request":
                return mint(holder, "another-request")
            if refusal == "wrong-worker":
                return mint("another-decode-worker", request)
            return ticket

        client._tickets.mint = spoiled  # type: ignore[method-assign]
        try:
            await _pull_posted(client, prefill.address, warm, layout, 40)  # forms the pair
            conn = await client._connections[prefill.address]
            armed[0] = True
            # a replayed ticket is the warm-up's, for its request (another request's would be wrong_request)
            target = {"unknown-request": "no-such-request", "replayed": warm}.get(refusal, rid)
            t0 = time.monotonic()
            with pytest.raises(KvTransferError) as failed:
                await _pull_posted(client, prefill.address, target, layout, 150)
            waited = time.monotonic() - t0
            stats = dict(vars(client.stats))
            _assert_pair_released(client, prefill.address, conn.pair)
            held = prefill.call("state")
            armed[0] = False
            kv = await _pull_posted(client, prefill.address, rid, layout, 150)  # the KV is still there
            return failed.value.with_traceback(None), waited, stats, held, kv, client.stats
        finally:
            await client.close()

    error, waited, stats, held, kv, after = asyncio.run(run())
    assert error.reason is REFUSALS[refusal], error
    assert waited < FAST_S, f"the refused pull took {waited:.2f}s"
    assert stats["abandoned_posts"] == 1 and stats["posted_pulls"] == 1  # the warm-up only
    assert held["held"] == [rid] and held["sending"] == [] and held["integrity"] is None
    assert torch.equal(kv.blocks, sent)
    assert after.connects == 2 and after.posted_pulls == 2  # the pair was formed anew, posted again
    prefill.assert_all_free()


def test_a_wrong_token_count_is_ignored_by_the_server_and_the_kv_arrives_anyway(prefill, checkpoint, model):  # noqa: F811
    layout = _engine(checkpoint, model).layout
    prefill.prefill("miscount", _prompt(150, seed=76))
    sent = prefill.call("export", "miscount")
    before = prefill.call("state")["posted_pulls"]

    async def run():
        client = _client("decode-miscount")
        try:
            kv = await _pull_posted(client, prefill.address, "miscount", layout, 149)  # the same 10 blocks
            return kv, client.stats
        finally:
            await client.close()

    kv, stats = asyncio.run(run())
    assert torch.equal(kv.blocks, sent) and kv.num_tokens == 150
    assert stats.posted_pulls == 0 and stats.abandoned_posts == 1 and stats.pulls == 1
    state = prefill.assert_all_free()
    assert state["posted_pulls"] == before


def test_a_prefill_worker_killed_mid_send_fails_the_posted_pull_at_once(checkpoint, model):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    stall = dict(PATHS["direct"][0], chunk_bytes=4096, fault_send_stall_s=120.0)
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint), stall), daemon=True)
    proc.start()
    try:
        assert ours.poll(60), f"the prefill process did not start (exit code {proc.exitcode})"
        victim = PrefillProcess(proc, ours, ours.recv())
        victim.prefill("doomed", _prompt(70, seed=77))
        layout = _engine(checkpoint, model).layout

        async def run():
            client = _client("decode-posted-bereaved")
            try:
                pull = asyncio.ensure_future(_pull_posted(client, victim.address, "doomed", layout, 70))
                while "doomed" not in (await asyncio.to_thread(victim.call, "state"))["sending"]:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # well inside the stall: the first piece is out
                proc.kill()
                t0 = time.monotonic()
                with pytest.raises(KvTransferError) as failed:
                    await pull
                error = failed.value.with_traceback(None)
                return error, time.monotonic() - t0, client.stats, dict(client._connections)
            finally:
                await client.close()

        error, waited, stats, connections = asyncio.run(run())
        assert error.reason is FailureReason.UNAVAILABLE
        assert waited < FAST_S, f"the pull took {waited:.1f}s to notice"
        # the reply (posted) came before the stall: the waited receives failed as the connection closed
        assert stats.pulls == 0 and stats.abandoned_posts == 0 and victim.address not in connections
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
