"""KV pulled across real processes: a prefill process serves KvTransfer, this process pulls and decodes.

The prefill process (spawned) loads the tiny demo checkpoint, prefills on request with hold_kv, and
answers state queries over a pipe; the pull itself goes over gRPC + a gloo pair, as between services.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection

import grpc
import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.kv.transfer import EngineKvSource, FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.pair import DECODE_RANK, Backend, Pair, store_client
from shared.kv.transfer.wire import announced_layout
from shared.model.demo import write_demo_checkpoint
from shared.model.loader import load_model
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc

TIMEOUT_S = 20.0
ENGINE_OPTS = dict(num_kv_blocks=48, max_model_len=512, max_num_batched_tokens=128)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


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
    """Serve pulls; between them run the commands the test sends: ("prefill", id, prompt) → (first
    tokens, ticket); ("state",) → block and server counts; ("stop",)."""
    engine = Engine(EngineConfig(model=checkpoint, **ENGINE_OPTS))
    source = EngineKvSource(engine)
    server = KvTransferServer("127.0.0.1", 0, source, timeout_s=TIMEOUT_S)
    conn.send(await server.start())
    try:
        while True:
            op, *args = await asyncio.to_thread(conn.recv)  # the loop keeps serving meanwhile
            if op == "stop":
                break
            if op == "prefill":
                rid, prompt = args
                engine.add_request(rid, prompt, PREFILL, hold_kv=True)
                conn.send((_run(engine), source.hold(rid)))
            elif op == "state":
                try:
                    engine.check_integrity()
                    integrity = None
                except AssertionError as e:
                    integrity = str(e)
                free, total = engine.blocks.num_free, engine.blocks.num_blocks
                conn.send(dict(free=free, total=total, held=source.held, integrity=integrity, **vars(server.stats)))
    finally:
        await server.stop()


@dataclasses.dataclass
class PrefillProcess:
    proc: mp.Process
    conn: Connection
    address: str

    def call(self, *command):
        self.conn.send(command)
        if not self.conn.poll(60):
            raise TimeoutError(f"prefill process did not answer {command[0]!r}")
        return self.conn.recv()

    def prefill(self, rid: str, prompt: list[int]) -> tuple[list[int], str]:
        return self.call("prefill", rid, prompt)

    def settled_state(self) -> dict:
        """State once no KV is held any more (a release follows the send, so it may lag the recv)."""
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def prefill(checkpoint):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint)), daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise RuntimeError(f"the prefill process did not start (exit code {proc.exitcode})")
        yield PrefillProcess(proc, ours, ours.recv())
        ours.send(("stop",))
        proc.join(15)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _engine(checkpoint, model, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), **(ENGINE_OPTS | overrides)), model)


def _pull(address: str, worker: str, *pulls: tuple[str, str], layout) -> tuple[list, KvTransferClient]:
    """Pull (request id, ticket)s concurrently with one new client; each result is a KVExport or the error."""

    async def run():
        client = KvTransferClient(worker, timeout_s=TIMEOUT_S)
        try:
            coros = [client.pull(address, rid, ticket, layout) for rid, ticket in pulls]
            return await asyncio.gather(*coros, return_exceptions=True), client
        finally:
            await client.close()

    return asyncio.run(run())


# ---- tests ------------------------------------------------------------------------------------------------


def test_pull_then_decode_matches_one_engine(prefill, checkpoint, model):
    prompt = _prompt(70, seed=7)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = _engine(checkpoint, model)
    whole.add_request("a", prompt, params)
    expected = _run(whole)

    first, ticket = prefill.prefill("a", prompt)
    assert prefill.call("state")["held"] == ["a"]
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=96)  # blocks re-cut on import
    (kv,), client = _pull(prefill.address, "decode-exact", ("a", ticket), layout=decode.layout)
    assert not isinstance(kv, Exception), kv
    assert kv.num_tokens == len(prompt) and kv.layout.block_size == 16
    assert client.stats.bytes_received == kv.nbytes

    decode.import_kv("a", prompt, first, params, kv)
    assert first + _run(decode) == expected
    assert decode.stats.prefill_tokens == 0  # the decode side never ran the prompt
    decode.check_integrity()
    state = prefill.assert_all_free()  # the pull freed the prefill blocks
    assert state["failed_sends"] == 0


def test_wrong_ticket_keeps_kv_and_unknown_request_fails(prefill, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    _, ticket = prefill.prefill("b", _prompt(40, seed=8))
    (bad, unknown), _ = _pull(prefill.address, "decode-denied", ("b", "x" + ticket), ("nope", ticket), layout=layout)
    assert isinstance(bad, KvTransferError) and bad.reason is FailureReason.DENIED
    assert isinstance(unknown, KvTransferError) and unknown.reason is FailureReason.NOT_FOUND
    state = prefill.call("state")
    assert state["held"] == ["b"] and state["free"] < state["total"]  # the refused pull left the KV in place

    (kv,), _ = _pull(prefill.address, "decode-denied", ("b", ticket), layout=layout)
    assert kv.num_tokens == 40
    prefill.assert_all_free()
    (again,), _ = _pull(prefill.address, "decode-denied", ("b", ticket), layout=layout)
    assert isinstance(again, KvTransferError) and again.reason is FailureReason.NOT_FOUND


def test_pulls_share_one_pair_and_keep_transfers_apart(prefill, checkpoint, model):
    """Three pulls (two at once, one after) on one client: one process group, each tensor to its request."""
    local = _engine(checkpoint, model)
    # c0 and c1 fill the same number of blocks, so a tag mix-up would swap their data (and fail below)
    # rather than mismatch sizes (which gloo answers by aborting the receiving process).
    prompts = {"c0": _prompt(70, seed=1), "c1": _prompt(66, seed=2), "c2": _prompt(90, seed=3)}
    tickets = {rid: prefill.prefill(rid, p)[1] for rid, p in prompts.items()}
    pairs_before = prefill.call("state")["pairs_created"]

    async def run():
        client = KvTransferClient("decode-shared", timeout_s=TIMEOUT_S)
        try:
            pulls = [client.pull(prefill.address, rid, tickets[rid], local.layout) for rid in ("c0", "c1")]
            kvs = await asyncio.gather(*pulls)
            kvs.append(await client.pull(prefill.address, "c2", tickets["c2"], local.layout))
            return kvs, client.stats
        finally:
            await client.close()

    kvs, stats = asyncio.run(run())
    assert stats.connects == 1 and stats.pulls == 3
    state = prefill.assert_all_free()
    assert state["pairs_created"] - pairs_before == 1
    for (rid, prompt), kv in zip(prompts.items(), kvs, strict=True):
        local.add_request(rid, prompt, PREFILL, hold_kv=True)
        _run(local)
        mine = local.export_kv(rid)
        assert kv.num_tokens == len(prompt) and kv.blocks.shape == mine.blocks.shape
        # Slots past num_tokens hold whatever the pool had there: compare the tokens only.
        flat = (t.blocks.flatten(2, 3)[:, :, : len(prompt)] for t in (kv, mine))
        torch.testing.assert_close(*flat, rtol=1e-5, atol=1e-5)


def test_replaced_pair_is_renegotiated_transparently(prefill, checkpoint, model):
    """A pair the server no longer knows (here: replaced by a second client under the same worker id, as
    after a decode restart) is answered with ABORTED; the client forms a new pair and pulls once more."""
    layout = _engine(checkpoint, model).layout
    tickets = {rid: prefill.prefill(rid, _prompt(20, seed=i))[1] for i, rid in enumerate(("f0", "f1", "f2"))}

    async def run():
        first, second = (KvTransferClient("decode-twin", timeout_s=TIMEOUT_S) for _ in range(2))
        try:
            await first.pull(prefill.address, "f0", tickets["f0"], layout)
            await second.pull(prefill.address, "f1", tickets["f1"], layout)  # replaces first's pair
            kv = await first.pull(prefill.address, "f2", tickets["f2"], layout)
            return kv, first.stats
        finally:
            await first.close()
            await second.close()

    kv, stats = asyncio.run(run())
    assert kv.num_tokens == 20
    assert stats.connects == 2 and stats.pulls == 2
    prefill.assert_all_free()


def test_incompatible_layout_and_unreachable_worker_fail_clearly(prefill, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    _, ticket = prefill.prefill("d", _prompt(30, seed=9))
    wider = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * 2)
    (mismatch,), _ = _pull(prefill.address, "decode-wider", ("d", ticket), layout=wider)
    assert isinstance(mismatch, KvTransferError) and mismatch.reason is FailureReason.INCOMPATIBLE
    assert prefill.call("state")["held"] == ["d"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    (gone,), _ = _pull(nobody, "decode-lost", ("d", ticket), layout=layout)
    assert isinstance(gone, KvTransferError) and gone.reason is FailureReason.UNAVAILABLE

    (kv,), _ = _pull(prefill.address, "decode-ok", ("d", ticket), layout=layout)
    assert kv.num_tokens == 30
    prefill.assert_all_free()


def test_a_peer_that_never_joins_stalls_no_other_pair(prefill, checkpoint, model):
    """A decode worker that connects and then hangs holds the server's half-built pair until the timeout;
    meanwhile other decode workers must connect and pull as usual."""
    layout = _engine(checkpoint, model).layout
    _, ticket = prefill.prefill("e", _prompt(30, seed=10))

    async def run():
        channel = grpc.aio.insecure_channel(prefill.address)
        request = pb.ConnectRequest(
            decode_worker_id="decode-ghost", backend=pb.BACKEND_GLOO, layout_fingerprint=layout.fingerprint
        )
        ghost = await pb_grpc.KvTransferStub(channel).Connect(request)
        client = KvTransferClient("decode-live", timeout_s=TIMEOUT_S)
        try:
            t0 = time.monotonic()
            kv = await client.pull(prefill.address, "e", ticket, layout)
            elapsed = time.monotonic() - t0
        finally:
            await client.close()
        # The ghost joins after all: the server's join ends now rather than at its timeout.
        store = store_client(ghost.store_host, ghost.store_port, TIMEOUT_S)
        await asyncio.to_thread(Pair.join, Backend.GLOO, store, ghost.pair_id, DECODE_RANK, TIMEOUT_S, "127.0.0.1")
        await channel.close()
        return kv, elapsed

    kv, elapsed = asyncio.run(run())
    assert kv.num_tokens == 30
    assert elapsed < TIMEOUT_S / 4, f"the pull waited {elapsed:.1f}s behind the ghost's join"
    prefill.assert_all_free()


def test_client_and_server_validate_their_settings():
    with pytest.raises(ValueError, match="backend"):
        KvTransferClient("w", backend="carrier-pigeon")
    with pytest.raises(ValueError, match="timeout"):
        KvTransferClient("w", timeout_s=0)
    with pytest.raises(ValueError, match="worker_id"):
        KvTransferClient("")


def test_recv_buffers_are_reused_once_given_back():
    buffers = BufferPool(max_cached_bytes=1 << 20, device="cpu")
    a = buffers.take((2, 2, 3, 16, 2, 16), torch.float32)
    assert buffers.give_back(a) and not buffers.give_back(a)  # a second give-back is refused
    b = buffers.take((2, 2, 2, 16, 2, 16), torch.float32)  # smaller: a view of a's memory
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and b.is_contiguous()
    c = buffers.take((2, 2, 2, 16, 2, 16), torch.float32)  # a's memory is out: a new buffer
    assert c.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert not buffers.give_back(torch.empty(4))  # not ours
    assert not BufferPool(max_cached_bytes=16, device="cpu").give_back(a)  # never lent by that one
    big = BufferPool(max_cached_bytes=100, device="cpu")
    assert not big.give_back(big.take((64,), torch.float32)) and big.cached_bytes == 0  # past the cap


def test_announcement_must_fit_the_receivers_layout(checkpoint, model):
    layout = _engine(checkpoint, model).layout  # 2 layers, 2 KV heads, head dim 16, float32

    def announce(**changes) -> pb.PullReply:
        fields = dict(num_tokens=70, shape=[2, 2, 9, 8, 2, 16], dtype="float32", block_size=8, tag=1)
        return pb.PullReply(**(fields | changes))

    assert announced_layout(announce(), layout) == dataclasses.replace(layout, block_size=8)
    bad = [
        dict(dtype="bfloat16"),
        dict(shape=[2, 2, 9, 8, 4, 16]),  # KV heads
        dict(shape=[2, 2, 5, 8, 2, 16]),  # too few blocks for 70 tokens
        dict(shape=[2, 2, 9, 8, 2]),
        dict(block_size=0, shape=[2, 2, 9, 0, 2, 16]),
        dict(num_tokens=0),
    ]
    for change in bad:
        with pytest.raises(KvTransferError) as err:
            announced_layout(announce(**change), layout)
        assert err.value.reason is FailureReason.PROTOCOL, change
