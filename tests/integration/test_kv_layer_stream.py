"""Layer-streamed hand-off across real processes: the pull starts while the prefill's last chunk still runs.

A spawned prefill process steps its engine on a thread of its own (as AsyncEngine does) and serves KvTransfer
on its loop. A prompt is added with hold_kv and watched (`EngineKvBlocks.watch`); when its last chunk starts,
the KV is held and the test is told, while the step goes on. A gate can hold the forward pass inside a layer
(layer 1 of the tiny model's 2), so the tests pull with layer 0 sent and layer 1 not yet written: the pull
completes only once every layer and the first token (the trailer) arrived, and an abort or a SIGKILL of the
prefill process at that point fails it at once and leaves nothing allocated on either side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest
import torch

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.transfer import EngineKvBlocks, FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer.layer_stream import StreamedKv

TIMEOUT_S = 20.0
SECRET = b"test-cluster-secret-0123456789"
# 128-token chunks: a 300-token prompt is prefilled in three steps, only the last of which is streamed
ENGINE_OPTS: dict = dict(num_kv_blocks=64, max_model_len=1024, scheduler=SchedulerConfig(max_num_batched_tokens=128))
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
GATED_LAYER = 1


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


# ---- the prefill process ----------------------------------------------------------------------------------


def _prefill_main(conn: Connection, checkpoint: str) -> None:
    asyncio.run(_prefill_serve(conn, checkpoint))


async def _prefill_serve(conn: Connection, checkpoint: str) -> None:
    """Commands: ("stream", id, prompt, gated) → once its last chunk started and its KV is held: the layers
    done so far; ("first", id) → its first token once the prefill ended; ("open",) → the gate opens;
    ("cancel", id) → the held KV is released (as a Cancel does); ("configure", path) → the sends of PATHS[path]
    from now on; ("sending",) → the keys being sent; ("state",) → blocks, held keys, stats."""
    loop = asyncio.get_running_loop()
    engine = Engine.build(EngineConfig(model=checkpoint, **ENGINE_OPTS))
    engine_thread = concurrent.futures.ThreadPoolExecutor(1)  # the engine's own thread, as AsyncEngine has

    async def call(fn):
        return await loop.run_in_executor(engine_thread, fn, engine)

    blocks = EngineKvBlocks(engine, call=call)
    held = HeldKv(blocks, lease_s=600.0)
    server = KvTransferServer("127.0.0.1", 0, held, secret=SECRET, timeout_s=TIMEOUT_S)
    gate = threading.Event()
    layer = engine.model.model.layers[GATED_LAYER]
    forward = layer.forward

    def gated_forward(*args):
        # only the streamed step (the last chunk's) waits: earlier chunks run through
        if engine.model.on_layer is not None and not gate.wait(60):  # never longer than a test
            raise RuntimeError("the gate stayed shut")
        return forward(*args)

    firsts: dict[str, asyncio.Future[list[int]]] = {}
    conn.send(await server.start())
    try:
        while True:
            op, *args = await asyncio.to_thread(conn.recv)
            if op == "stop":
                break
            if op == "stream":
                rid, prompt, gated = args
                started: asyncio.Future[int] = loop.create_future()
                if gated:
                    gate.clear()
                    layer.forward = gated_forward
                else:
                    layer.forward = forward

                def announce(start, rid=rid, started=started):
                    loop.call_soon_threadsafe(started.set_result, start.progress.layers_done)

                def add(e: Engine, rid=rid, prompt=prompt):
                    e.add_request(rid, prompt, PREFILL, hold_kv=True)
                    blocks.watch(e, rid, announce)

                await call(add)
                firsts[rid] = asyncio.ensure_future(call(_run))
                layers_done = await started
                await held.hold(rid, rid, 0)  # the hand-off is announced: a decode worker may pull now
                conn.send(layers_done)
            elif op == "first":
                conn.send(await firsts.pop(args[0]))
            elif op == "open":
                gate.set()
                conn.send(None)
            elif op == "configure":
                settings = PATHS[args[0]]
                blocks.min_segment_bytes = settings["min_segment_bytes"]
                server.chunk_bytes = settings.get("chunk_bytes", 0)
                conn.send(None)
            elif op == "cancel":
                await held.release(args[0])
                conn.send(None)
            elif op == "sending":  # not through the engine's thread, which the gate may hold
                conn.send([key for key in held.keys() if held.is_sending(key)])
            elif op == "state":
                integrity = None
                try:
                    await call(lambda e: e.check_integrity())
                except AssertionError as e:
                    integrity = str(e)
                free, total = engine.blocks.num_free, engine.blocks.num_blocks
                conn.send(dict(free=free, total=total, held=held.keys(), integrity=integrity, **vars(server.stats)))
    finally:
        gate.set()
        await server.stop()


@dataclasses.dataclass
class PrefillProcess:
    proc: BaseProcess
    conn: Connection
    address: str

    def call(self, *command):
        self.conn.send(command)
        if not self.conn.poll(60):
            raise TimeoutError(f"prefill process did not answer {command[0]!r}")
        return self.conn.recv()

    async def until_sending(self, rid: str) -> None:
        """Return once the pull of `rid` was accepted (its stream is on the wire, waiting for layer 1)."""
        deadline = time.monotonic() + TIMEOUT_S
        while rid not in await asyncio.to_thread(self.call, "sending"):
            assert time.monotonic() < deadline, f"the pull of {rid!r} never started"
            await asyncio.sleep(0.02)

    def settled_state(self) -> dict:
        """State once nothing is held any more (the release follows the send's end, so it may lag)."""
        deadline = time.monotonic() + 10
        while (state := self.call("state"))["held"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return state

    def assert_all_free(self) -> dict:
        state = self.settled_state()
        assert state["held"] == []
        assert state["integrity"] is None, state["integrity"]
        assert state["free"] == state["total"]
        return state


def _start(checkpoint) -> PrefillProcess:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint)), daemon=True)
    proc.start()
    if not ours.poll(180):  # a loaded machine: spawning and loading torch may take a while
        proc.kill()
        raise RuntimeError(f"the prefill process did not start (exit code {proc.exitcode})")
    return PrefillProcess(proc, ours, ours.recv())


def _stop(prefill: PrefillProcess) -> None:
    if prefill.proc.is_alive():
        try:
            prefill.conn.send(("stop",))
        except BrokenPipeError:  # killed by its test and not yet reaped: is_alive() still said so
            pass
        prefill.proc.join(15)
    if prefill.proc.is_alive():
        prefill.proc.kill()
        prefill.proc.join(5)


# direct: each (layer, plane, run) a view of the pool (a fresh prefill's blocks are one run); layered: the runs
# are "too short" (threshold raised), so each layer is gathered once it is written; chunked: pieces of 4 KiB
PATHS = {
    "direct": dict(min_segment_bytes=1),
    "layered": dict(min_segment_bytes=1 << 40),
    "chunked": dict(min_segment_bytes=1, chunk_bytes=4096),
}


@pytest.fixture(scope="module")
def prefill(checkpoint):
    process = _start(checkpoint)
    try:
        process.call("configure", "direct")
        yield process
    finally:
        _stop(process)


def _engine(checkpoint, model, **overrides) -> Engine:
    return Engine.build(EngineConfig(model=str(checkpoint), **(ENGINE_OPTS | overrides)), model)


def _client(worker: str) -> KvTransferClient:
    return KvTransferClient(worker, secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=True)


# ---- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_a_streamed_pull_hands_off_identical_bytes_and_decodes_exactly(prefill, checkpoint, model, path):
    """The pull starts with one layer written; it completes only after the gate opens, with every byte of the
    prefill's KV and its first token; the decode side continues token for token as one engine would."""
    prefill.call("configure", path)
    prompt = _prompt(300, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole = _engine(checkpoint, model)
    whole.add_request("w", prompt, params)
    expected = _run(whole)
    reference = _engine(checkpoint, model)  # the prefill's KV, computed here unstreamed, to compare bytes with
    reference.add_request("s", prompt, PREFILL, hold_kv=True)
    _run(reference)
    want = reference.export_kv("s")

    assert prefill.call("stream", "s", prompt, True) == 0  # held (the hand-off announced) before any layer is done
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=128)

    async def run():
        client = _client("decode-stream")
        try:
            pull = asyncio.ensure_future(client.pull(prefill.address, "s", decode.layout))
            await prefill.until_sending("s")
            await asyncio.sleep(0.2)
            assert not pull.done()  # layer 1 is not written yet: decode may not begin
            await asyncio.to_thread(prefill.call, "open")
            return await asyncio.wait_for(pull, TIMEOUT_S), client.stats
        finally:
            await client.close()

    kv, stats = asyncio.run(run())
    first = prefill.call("first", "s")
    prefill.call("configure", "direct")
    assert isinstance(kv, StreamedKv) and [kv.first_token] == first  # the trailer carried the first token
    assert stats.streamed_pulls == 1 and stats.shm_pulls == 0  # the same-host segment is not used for a stream
    assert kv.num_tokens == len(prompt) and torch.equal(kv.blocks, want.blocks)  # bytes identical, padding too
    decode.import_kv("s", prompt, [kv.first_token], params, kv)
    assert first + _run(decode) == expected
    assert decode.stats.prefill_tokens == 0
    decode.check_integrity()
    state = prefill.assert_all_free()
    assert state["streamed_pulls"] >= 1 and state["failed_sends"] == 0


def test_a_pull_after_the_prefill_ended_still_gets_the_first_token(prefill, checkpoint, model):
    prompt = _prompt(200, seed=4)
    assert prefill.call("stream", "late", prompt, False) == 0  # ungated: the prefill runs on at once
    first = prefill.call("first", "late")
    layout = _engine(checkpoint, model).layout

    async def run():
        client = _client("decode-late")
        try:
            return await client.pull(prefill.address, "late", layout)
        finally:
            await client.close()

    kv = asyncio.run(run())
    assert isinstance(kv, StreamedKv) and [kv.first_token] == first and kv.num_tokens == 200
    prefill.assert_all_free()


def test_an_abort_midway_fails_the_pull_and_frees_both_sides(prefill, checkpoint, model):
    """Cancelled while layer 1 is being computed (layer 0 on the wire): the stream stops at once, the pull fails
    (the caller recomputes or fails per kv_fallback), the prefill frees its blocks and the client its pair."""
    prompt = _prompt(300, seed=5)
    assert prefill.call("stream", "x", prompt, True) == 0
    layout = _engine(checkpoint, model).layout

    async def run():
        client = _client("decode-abort")
        try:
            pull = asyncio.ensure_future(client.pull(prefill.address, "x", layout))
            await prefill.until_sending("x")
            await asyncio.sleep(0.1)  # layer 0 on the wire, layer 1 held by the gate
            await asyncio.to_thread(prefill.call, "cancel", "x")
            t0 = time.monotonic()
            with pytest.raises(KvTransferError) as failed:
                await pull
            return failed.value, time.monotonic() - t0, client
        finally:
            await client.close()

    error, waited, client = asyncio.run(run())
    assert error.reason is FailureReason.UNAVAILABLE and waited < TIMEOUT_S / 4
    assert client.stats.pulls == 0 and client.shm_free_bytes(prefill.address) is None  # the pair is forgotten
    prefill.call("open")
    prefill.call("first", "x")  # the step itself completes; its blocks go with the release
    state = prefill.assert_all_free()
    assert state["failed_sends"] >= 1


def test_a_prefill_worker_killed_mid_stream(checkpoint, model):
    """SIGKILL while layer 1 is being computed: the pull fails at once, and this side keeps nothing."""
    victim = _start(checkpoint)
    try:
        victim.call("configure", "direct")
        assert victim.call("stream", "doomed", _prompt(300, seed=6), True) == 0
        layout = _engine(checkpoint, model).layout

        async def run():
            client = _client("decode-bereaved")
            try:
                pull = asyncio.ensure_future(client.pull(victim.address, "doomed", layout))
                await victim.until_sending("doomed")
                await asyncio.sleep(0.1)
                assert not pull.done()
                victim.proc.kill()
                t0 = time.monotonic()
                with pytest.raises(KvTransferError) as failed:
                    await pull
                return failed.value, time.monotonic() - t0, client
            finally:
                await client.close()

        error, waited, client = asyncio.run(run())
        assert error.reason is FailureReason.UNAVAILABLE
        assert waited < TIMEOUT_S / 4, f"the pull took {waited:.1f}s to notice"
        assert client.stats.pulls == 0 and client.shm_free_bytes(victim.address) is None
    finally:
        _stop(victim)
