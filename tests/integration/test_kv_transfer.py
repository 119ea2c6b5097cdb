"""KV pulled across real processes: a prefill process serves KvTransfer, this process pulls and decodes.

The prefill process (spawned) loads the tiny demo checkpoint, prefills on request with hold_kv, and
answers state queries over a pipe; the pull itself goes over gRPC + a gloo pair, as between services, or
through the pair's shared segment (both processes run on this host). The tests from
`test_every_path_hands_off_identical_bytes` on run each path: shared memory, and over the socket straight
from the pool (direct runs, contiguous or scattered; layered gather; flat) or from an export copy.
Both sides share SECRET, as a deployment's workers share the cluster secret. Refusals of bad tickets and
malformed calls are tested in test_kv_security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import pytest
import torch

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.tickets import Tickets
from shared.kv.transfer import EngineKvBlocks, FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.pair import DECODE_RANK, Pair, TransferBackend, store_client
from shared.kv.transfer.pair_proof import PairProofs
from shared.kv.transfer.shm import PREFIX, SHM_DIR
from shared.kv.transfer.wire import announced_layout, num_pieces, pieces
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc

TIMEOUT_S = 20.0
LEASE_S = 600.0  # held KV outlives every test here: only pulls free it
SECRET = b"test-cluster-secret-0123456789"
ENGINE_OPTS = dict(num_kv_blocks=48, max_model_len=512, scheduler=SchedulerConfig(max_num_batched_tokens=128))
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


# ---- the prefill process ----------------------------------------------------------------------------------


def _prefill_main(conn: Connection, checkpoint: str, settings: dict | None = None) -> None:
    asyncio.run(_prefill_serve(conn, checkpoint, settings or {}))


# What "configure" may set: the server's attributes, and those of the source's engine blocks (pool_kv.py).
SERVER_SETTINGS = ("chunk_bytes", "fault_send_midway", "fault_send_stall_s", "shm_bytes")
BLOCKS_SETTINGS = ("small_kv_bytes", "min_segment_bytes", "from_pool")


async def _prefill_serve(conn: Connection, checkpoint: str, settings: dict) -> None:
    """Serve pulls; between them run the commands the test sends: ("prefill", id, prompt, scatter) → first
    tokens; ("export", id) → the request's KV as a copy; ("configure", settings or None) → None;
    ("state",) → block and server counts; ("stop",). settings["shared_pool"]: the pool in a memfd, offered to
    same-host pairs to borrow from (test_kv_borrow.py)."""
    shared = settings.pop("shared_pool", False)
    engine = Engine.build(EngineConfig(model=checkpoint, kv_shared_memory=shared, **ENGINE_OPTS))
    blocks = EngineKvBlocks(engine)
    source = HeldKv(blocks, lease_s=LEASE_S)
    server = KvTransferServer(
        "127.0.0.1", 0, source, secret=SECRET, timeout_s=TIMEOUT_S, shared_pool=engine.pool.handle()
    )
    owners = {name: server for name in SERVER_SETTINGS} | {name: blocks for name in BLOCKS_SETTINGS}
    defaults = {name: getattr(owner, name) for name, owner in owners.items()}

    def configure(changes: dict) -> None:
        for name, value in changes.items():
            setattr(owners[name], name, value)

    configure(settings)
    conn.send(await server.start())
    try:
        while True:
            op, *args = await asyncio.to_thread(conn.recv)  # the loop keeps serving meanwhile
            if op == "stop":
                break
            if op == "prefill":
                rid, prompt, scatter = args
                # scatter: the request gets every other free block (runs of one), as in a fragmented pool
                spacers = engine.blocks.allocate(engine.blocks.num_free) if scatter else []
                engine.blocks.free(spacers[1::2])
                engine.add_request(rid, prompt, PREFILL, hold_kv=True)
                first = _run(engine)
                engine.blocks.free(spacers[::2])
                await source.hold(rid, rid, 0)
                conn.send(first)
            elif op == "export":
                conn.send(engine.export_kv(args[0]).blocks)
            elif op == "configure":  # read by every pull (and new pair) from now on; None restores the defaults
                configure(defaults if args[0] is None else args[0])
                conn.send(None)
            elif op == "state":
                try:
                    engine.check_integrity()
                    integrity = None
                except AssertionError as e:
                    integrity = str(e)
                free, total = engine.blocks.num_free, engine.blocks.num_blocks
                sending = [key for key in source.keys() if source.is_sending(key)]
                held = source.keys()
                conn.send(
                    dict(free=free, total=total, held=held, sending=sending, integrity=integrity, **vars(server.stats))
                )
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

    def prefill(self, rid: str, prompt: list[int], scatter: bool = False) -> list[int]:
        return self.call("prefill", rid, prompt, scatter)

    @contextlib.contextmanager
    def configured(self, **settings):
        self.call("configure", settings)
        try:
            yield
        finally:
            self.call("configure", None)

    def settled_state(self, held: tuple[str, ...] = ()) -> dict:
        """State once only `held` is held (a release follows the send, so it may lag the recv)."""
        deadline = time.monotonic() + 10
        while sorted((state := self.call("state"))["held"]) != sorted(held) and time.monotonic() < deadline:
            time.sleep(0.02)
        return state

    def assert_all_free(self) -> dict:
        state = self.settled_state()
        assert state["held"] == []
        assert state["integrity"] is None, state["integrity"]
        assert state["free"] == state["total"]
        return state


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
    return Engine.build(EngineConfig(model=str(checkpoint), **(ENGINE_OPTS | overrides)), model)


def _generated(checkpoint, model, prompt: list[int], params: SamplingParams) -> list[int]:
    """What one engine, prefill and decode in one, generates for `prompt`: the tokens every hand-off must match."""
    whole = _engine(checkpoint, model)
    whole.add_request("whole", prompt, params)
    return _run(whole)


def _client(worker: str, secret: bytes = SECRET, shared_memory: bool = False) -> KvTransferClient:
    """A puller; over the socket unless `shared_memory` (the tests before the per-path ones test the socket)."""
    return KvTransferClient(worker, secret=secret, timeout_s=TIMEOUT_S, shared_memory=shared_memory)


def _pull(
    address: str, worker: str, *request_ids: str, layout, secret: bytes = SECRET, shared_memory: bool = False
) -> tuple[list, KvTransferClient]:
    """Pull request ids concurrently with one new client; each result is a KVExport or the error."""

    async def run():
        client = _client(worker, secret, shared_memory)
        try:
            coros = [client.pull(address, rid, layout) for rid in request_ids]
            return await asyncio.gather(*coros, return_exceptions=True), client
        finally:
            await client.close()

    return asyncio.run(run())


# ---- tests ------------------------------------------------------------------------------------------------


def test_pull_then_decode_matches_one_engine(prefill, checkpoint, model):
    prompt = _prompt(70, seed=7)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = _generated(checkpoint, model, prompt, params)

    first = prefill.prefill("a", prompt)
    assert prefill.call("state")["held"] == ["a"]
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=96)  # blocks re-cut on import
    (kv,), client = _pull(prefill.address, "decode-exact", "a", layout=decode.layout)
    assert not isinstance(kv, Exception), kv
    assert kv.num_tokens == len(prompt) and kv.layout.block_size == 16
    assert client.stats.bytes_received == kv.nbytes

    decode.import_kv("a", prompt, first, params, kv)
    assert first + _run(decode) == expected
    assert decode.stats.prefill_tokens == 0  # the decode side never ran the prompt
    decode.check_integrity()
    state = prefill.assert_all_free()  # the pull freed the prefill blocks
    assert state["failed_sends"] == 0


def test_another_secret_is_denied_keeps_kv_and_unknown_request_fails(prefill, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    prefill.prefill("b", _prompt(40, seed=8))
    (bad,), _ = _pull(prefill.address, "decode-denied", "b", layout=layout, secret=b"another-cluster-secret-42")
    assert isinstance(bad, KvTransferError) and bad.reason is FailureReason.DENIED  # its Connect is refused
    (unknown,), _ = _pull(prefill.address, "decode-denied", "nope", layout=layout)
    assert isinstance(unknown, KvTransferError) and unknown.reason is FailureReason.NOT_FOUND
    state = prefill.call("state")
    assert state["held"] == ["b"] and state["free"] < state["total"]  # the refused pull left the KV in place

    (kv,), _ = _pull(prefill.address, "decode-denied", "b", layout=layout)
    assert kv.num_tokens == 40
    prefill.assert_all_free()
    (again,), _ = _pull(prefill.address, "decode-denied", "b", layout=layout)
    assert isinstance(again, KvTransferError) and again.reason is FailureReason.NOT_FOUND


def test_pulls_share_one_pair_and_keep_transfers_apart(prefill, checkpoint, model):
    """Three pulls (two at once, one after) on one client: one process group, each tensor to its request."""
    local = _engine(checkpoint, model)
    # c0 and c1 fill the same number of blocks, so a tag mix-up would swap their data (and fail below)
    # rather than mismatch sizes (which gloo answers by aborting the receiving process).
    prompts = {"c0": _prompt(70, seed=1), "c1": _prompt(66, seed=2), "c2": _prompt(90, seed=3)}
    for rid, p in prompts.items():
        prefill.prefill(rid, p)
    pairs_before = prefill.call("state")["pairs_created"]

    async def run():
        client = _client("decode-shared")
        try:
            pulls = [client.pull(prefill.address, rid, local.layout) for rid in ("c0", "c1")]
            kvs = await asyncio.gather(*pulls)
            kvs.append(await client.pull(prefill.address, "c2", local.layout))
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
    for i, rid in enumerate(("f0", "f1", "f2")):
        prefill.prefill(rid, _prompt(20, seed=i))

    async def run():
        first, second = (_client("decode-twin") for _ in range(2))
        try:
            await first.pull(prefill.address, "f0", layout)
            await second.pull(prefill.address, "f1", layout)  # replaces first's pair
            kv = await first.pull(prefill.address, "f2", layout)
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
    prefill.prefill("d", _prompt(30, seed=9))
    wider = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * 2)
    (mismatch,), _ = _pull(prefill.address, "decode-wider", "d", layout=wider)
    assert isinstance(mismatch, KvTransferError) and mismatch.reason is FailureReason.INCOMPATIBLE
    assert prefill.call("state")["held"] == ["d"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    (gone,), _ = _pull(nobody, "decode-lost", "d", layout=layout)
    assert isinstance(gone, KvTransferError) and gone.reason is FailureReason.UNAVAILABLE

    (kv,), _ = _pull(prefill.address, "decode-ok", "d", layout=layout)
    assert kv.num_tokens == 30
    prefill.assert_all_free()


def test_a_peer_that_never_joins_stalls_no_other_pair(prefill, checkpoint, model):
    """A decode worker that connects and then hangs holds the server's half-built pair until the timeout;
    meanwhile other decode workers must connect and pull as usual."""
    layout = _engine(checkpoint, model).layout
    prefill.prefill("e", _prompt(30, seed=10))

    async def run():
        channel = grpc.aio.insecure_channel(prefill.address)
        request = pb.ConnectRequest(
            decode_worker_id="decode-ghost",
            backend=pb.BACKEND_GLOO,
            layout_fingerprint=layout.fingerprint,
            ticket=Tickets(SECRET).mint("decode-ghost"),
        )
        ghost = await pb_grpc.KvTransferStub(channel).Connect(request)
        client = _client("decode-live")
        try:
            t0 = time.monotonic()
            kv = await client.pull(prefill.address, "e", layout)
            elapsed = time.monotonic() - t0
        finally:
            await client.close()
        # The ghost joins after all: the server's join ends now rather than at its timeout.
        store = store_client(ghost.store_host, ghost.store_port, TIMEOUT_S)
        late = await asyncio.to_thread(
            Pair.join, TransferBackend.GLOO, store, ghost.pair_id, DECODE_RANK, TIMEOUT_S, "127.0.0.1"
        )
        await asyncio.to_thread(PairProofs(SECRET).confirm, late)  # the server's join ends with the proofs
        await channel.close()
        return kv, elapsed

    kv, elapsed = asyncio.run(run())
    assert kv.num_tokens == 30
    assert elapsed < TIMEOUT_S / 4, f"the pull waited {elapsed:.1f}s behind the ghost's join"
    prefill.assert_all_free()


def test_chunked_pulls_arrive_whole_and_apart(prefill, checkpoint, model):
    """Pieces of 4 KiB: a 70-token prompt's KV (40 KiB) moves in 10, a 45-token one in 6; two pulls at once
    on one pair, so their pieces interleave under distinct tags."""
    local = _engine(checkpoint, model)
    prompts = {"k0": _prompt(70, seed=11), "k1": _prompt(45, seed=12)}
    for rid, p in prompts.items():
        prefill.prefill(rid, p)
    with prefill.configured(chunk_bytes=4096):
        kvs, client = _pull(prefill.address, "decode-chunks", *prompts, layout=local.layout)
    assert client.stats.pulls == 2 and client.stats.connects == 1
    prefill.assert_all_free()
    for (rid, prompt), kv in zip(prompts.items(), kvs, strict=True):
        assert not isinstance(kv, Exception), kv
        local.add_request(rid, prompt, PREFILL, hold_kv=True)
        _run(local)
        flat = (t.blocks.flatten(2, 3)[:, :, : len(prompt)] for t in (kv, local.export_kv(rid)))
        torch.testing.assert_close(*flat, rtol=1e-5, atol=1e-5)


def test_a_send_that_fails_midway_frees_the_kv_and_the_next_pull_uses_a_new_pair(prefill, checkpoint, model):
    """The injected fault: the server sends the first piece (none when the KV is one piece), then drops the
    pair and frees the blocks. Closing its side of the group closes the connection, so the client's wait
    for the remaining pieces fails at once instead of at its timeout; its next pull negotiates a new pair."""
    layout = _engine(checkpoint, model).layout
    for i, (rid, n) in enumerate({"m0": 70, "m1": 70, "m2": 40}.items()):
        prefill.prefill(rid, _prompt(n, seed=13 + i))
    failed_before = prefill.call("state")["failed_sends"]

    async def run():
        client = _client("decode-fault")
        errors, waits = [], []
        try:
            for rid, chunk_bytes in (("m0", 4096), ("m1", 0)):  # ten pieces, first sent; one piece, none sent
                with prefill.configured(chunk_bytes=chunk_bytes, fault_send_midway=True):
                    t0 = time.monotonic()
                    with pytest.raises(KvTransferError) as failed:
                        await client.pull(prefill.address, rid, layout)
                    waits.append(time.monotonic() - t0)
                    errors.append(failed.value)
            after_faults = prefill.settled_state(held=("m2",))  # the failed sends released m0 and m1
            kv = await client.pull(prefill.address, "m2", layout)  # the fault is off again
            return errors, waits, after_faults, kv, client.stats
        finally:
            await client.close()

    errors, waits, after_faults, kv, stats = asyncio.run(run())
    assert all(e.reason is FailureReason.UNAVAILABLE for e in errors), errors
    assert max(waits) < TIMEOUT_S / 4, f"the client waited {waits} s for pieces that never came"
    assert after_faults["held"] == ["m2"] and after_faults["integrity"] is None
    assert after_faults["failed_sends"] - failed_before == 2
    assert kv.num_tokens == 40
    assert stats.connects == 3 and stats.pulls == 1  # a fresh pair after each failure
    prefill.assert_all_free()


def test_client_and_server_validate_their_settings():
    with pytest.raises(ValueError, match="backend"):
        KvTransferClient("w", secret=SECRET, backend="carrier-pigeon")
    with pytest.raises(ValueError, match="timeout"):
        KvTransferClient("w", secret=SECRET, timeout_s=0)
    with pytest.raises(ValueError, match="worker_id"):
        KvTransferClient("", secret=SECRET)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        KvTransferClient("w", secret=b"short")
    source = HeldKv.__new__(HeldKv)  # never used: the constructor refuses first
    with pytest.raises(ValueError, match="at least 16 bytes"):
        KvTransferServer("127.0.0.1", 0, source, secret="")
    with pytest.raises(ValueError, match="chunk_bytes"):
        KvTransferServer("127.0.0.1", 0, source, secret=SECRET, chunk_bytes=100)


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
        dict(num_tokens=70000, shape=[2, 2, 8750, 8, 2, 16], chunk_bytes=4),  # one element a piece: too many
    ]
    for change in bad:
        with pytest.raises(KvTransferError) as err:
            announced_layout(announce(**change), layout)
        assert err.value.reason is FailureReason.PROTOCOL, change


def test_both_sides_cut_the_same_pieces():
    kv = torch.arange(2 * 2 * 3 * 16 * 2 * 16, dtype=torch.float32).view(2, 2, 3, 16, 2, 16)  # 24 KiB
    assert pieces(kv, 0) == [kv] and pieces(kv, kv.numel() * 4) == [kv]  # one piece: the tensor as is
    for chunk_bytes in (1024, 1000, 4096, 5000, 3):
        parts = pieces(kv, chunk_bytes)
        assert len(parts) == num_pieces(kv.numel(), 4, chunk_bytes)
        assert all(p.is_contiguous() and p.numel() * 4 <= max(chunk_bytes, 4) for p in parts)
        assert torch.equal(torch.cat(parts), kv.view(-1))  # consecutive views, nothing lost or repeated
        received = torch.empty_like(kv)
        for mine, theirs in zip(pieces(received, chunk_bytes), parts, strict=True):
            mine.copy_(theirs)  # what the recv of each piece does
        assert torch.equal(received, kv)


# ---- every path: shared memory, straight from the pool (direct, layered, flat), an export copy ----------------

# path → (the prefill's settings, whether the prompt's blocks are scattered, whether the puller maps shared memory)
PATHS = {
    "shm": ({}, False, True),
    "direct": (dict(small_kv_bytes=0, min_segment_bytes=0), False, False),  # one run per (layer, plane)
    "direct-scattered": (dict(small_kv_bytes=0, min_segment_bytes=0), True, False),  # a run per block
    "layered": (dict(small_kv_bytes=0, min_segment_bytes=1 << 30), True, False),
    "flat": ({}, False, False),  # the demo's KV is small: one gathered message
    "export": (dict(from_pool=False), False, False),  # the export copy, as before
}


def _segments_of(pid: int) -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"{PREFIX}{pid}-*")]


def _mapped_segments() -> list[str]:
    """Shared KV segments this process still maps (unlinked ones show as "(deleted)")."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if PREFIX in line]


@pytest.mark.parametrize("path", PATHS)
def test_every_path_hands_off_identical_bytes_and_decodes_exactly(prefill, checkpoint, model, path):
    settings, scatter, shared_memory = PATHS[path]
    prompt = _prompt(150, seed=31)  # 10 blocks of 16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _generated(checkpoint, model, prompt, params)

    rid = f"path-{path}"
    first = prefill.prefill(rid, prompt, scatter=scatter)
    sent = prefill.call("export", rid)  # the bytes in the prefill pool, copied before the pull
    failed_before = prefill.call("state")["failed_sends"]
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=96)
    with prefill.configured(**settings):
        (kv,), client = _pull(prefill.address, f"decode-{path}", rid, layout=decode.layout, shared_memory=shared_memory)
    assert not isinstance(kv, Exception), kv
    assert torch.equal(kv.blocks, sent)  # every byte, padding slots included
    assert client.stats.shm_pulls == (1 if shared_memory else 0)
    assert client.stats.local_pulls == client.stats.shm_pulls  # same host: the Pull went over the Unix socket
    decode.import_kv(rid, prompt, first, params, kv)
    assert first + _run(decode) == expected
    decode.check_integrity()
    state = prefill.assert_all_free()
    assert state["failed_sends"] == failed_before
    del kv
    gc.collect()
    assert _mapped_segments() == []  # the client closed: its segment went with the last tensor on it


@pytest.mark.parametrize("path", ["shm", "direct-scattered", "layered"])
def test_a_send_that_fails_midway_frees_both_sides_on_every_path(prefill, checkpoint, model, path):
    settings, scatter, shared_memory = PATHS[path]
    layout = _engine(checkpoint, model).layout
    rids = [f"{path}-fault", f"{path}-after"]
    for i, rid in enumerate(rids):
        prefill.prefill(rid, _prompt(70, seed=40 + i), scatter=scatter)
    failed_before = prefill.call("state")["failed_sends"]

    async def run():
        client = _client(f"decode-fault-{path}", shared_memory=shared_memory)
        try:
            with prefill.configured(**settings, chunk_bytes=4096, fault_send_midway=True):
                with pytest.raises(KvTransferError) as failed:
                    await client.pull(prefill.address, rids[0], layout)
            after_fault = prefill.settled_state(held=(rids[1],))
            with prefill.configured(**settings):
                kv = await client.pull(prefill.address, rids[1], layout)
            # without its traceback: it holds this frame, and so `kv` and the segment under it
            return failed.value.with_traceback(None), after_fault, kv, client.stats
        finally:
            await client.close()

    error, after_fault, kv, stats = asyncio.run(run())
    assert error.reason is FailureReason.UNAVAILABLE
    assert after_fault["held"] == [rids[1]] and after_fault["integrity"] is None
    assert after_fault["failed_sends"] - failed_before == 1
    assert kv.num_tokens == 70 and stats.connects == 2 and stats.shm_pulls == (1 if shared_memory else 0)
    prefill.assert_all_free()
    del kv
    gc.collect()
    assert _mapped_segments() == []


def test_shared_memory_falls_back_to_the_socket_for_kv_that_does_not_fit(prefill, checkpoint, model):
    """A 64 KiB segment: the first pull (40 KiB) lands there; the second (80 KiB) goes over the pair. Once
    the tensors are gone the whole segment is free again."""
    layout = _engine(checkpoint, model).layout
    sizes = {"fit-small": 70, "fit-big": 150}
    for i, (rid, n) in enumerate(sizes.items()):
        prefill.prefill(rid, _prompt(n, seed=50 + i))
    segments_before = prefill.call("state")["segments"]

    async def run():
        client = _client("decode-fit", shared_memory=True)
        try:
            with prefill.configured(shm_bytes=64 << 10):
                kvs = [await client.pull(prefill.address, rid, layout) for rid in sizes]
            in_use = client.shm_free_bytes(prefill.address)
            kvs.clear()
            gc.collect()
            return in_use, client.shm_free_bytes(prefill.address), client.stats
        finally:
            await client.close()

    in_use, free, stats = asyncio.run(run())
    assert stats.pulls == 2 and stats.shm_pulls == 1
    assert stats.local_pulls == 2  # the pull that did not fit went over the pair, asked over the Unix socket
    assert in_use == (64 << 10) - (40 << 10) and free == 64 << 10
    state = prefill.assert_all_free()
    assert state["segments"] - segments_before == 1
    assert _segments_of(prefill.proc.pid) == []


def test_a_puller_on_another_host_gets_no_segment(prefill, checkpoint, model):
    layout = _engine(checkpoint, model).layout
    prefill.prefill("elsewhere", _prompt(30, seed=60))
    segments_before = prefill.call("state")["segments"]

    async def run():
        client = _client("decode-elsewhere", shared_memory=True)
        client.host_id = "another-boot/another-host/1"  # what a worker on another machine reports
        try:
            return await client.pull(prefill.address, "elsewhere", layout), client.stats
        finally:
            await client.close()

    kv, stats = asyncio.run(run())
    assert kv.num_tokens == 30 and stats.shm_pulls == 0
    assert prefill.assert_all_free()["segments"] == segments_before


@pytest.mark.parametrize("path", ["shm", "direct"])
def test_a_prefill_worker_killed_mid_transfer(checkpoint, model, path):
    """SIGKILL while a send stalls halfway (its first piece out, or half the bytes in shared memory): the
    pull fails at once, nothing of the dead worker is left in /dev/shm, and this side maps no segment."""
    settings, _, shared_memory = PATHS[path]
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    stall = dict(settings, chunk_bytes=4096, fault_send_stall_s=120.0)
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint), stall), daemon=True)
    proc.start()
    try:
        assert ours.poll(60), f"the prefill process did not start (exit code {proc.exitcode})"
        victim = PrefillProcess(proc, ours, ours.recv())
        victim.prefill("doomed", _prompt(70, seed=61))
        layout = _engine(checkpoint, model).layout

        async def run():
            client = _client(f"decode-bereaved-{path}", shared_memory=shared_memory)
            try:
                pull = asyncio.ensure_future(client.pull(victim.address, "doomed", layout))
                while "doomed" not in (await asyncio.to_thread(victim.call, "state"))["sending"]:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # well inside the stall
                named_while_sending = _segments_of(proc.pid)
                proc.kill()
                t0 = time.monotonic()
                with pytest.raises(KvTransferError) as failed:
                    await pull
                return failed.value, time.monotonic() - t0, named_while_sending, client
            finally:
                await client.close()

        error, waited, named_while_sending, client = asyncio.run(run())
        proc.join(10)
        assert error.reason is FailureReason.UNAVAILABLE
        assert waited < TIMEOUT_S / 4, f"the pull took {waited:.1f}s to notice"
        assert named_while_sending == []  # unlinked as soon as the pair formed
        assert _segments_of(proc.pid) == []
        assert client.stats.pulls == 0 and client.shm_free_bytes(victim.address) is None  # the pair is forgotten
        del client
        gc.collect()
        assert _mapped_segments() == []
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_the_warm_pair_carries_every_loop_posted_way_and_survives_a_replayed_ticket(prefill, checkpoint, model):
    """One client, one pair, formed once: pulls the direct, flat and export ways back to back (the sends
    posted from the server's loop, the recvs from the client's: loop_send.py), each bytes-identical to the
    pool; in between, a replayed ticket is refused (DENIED) without costing the pair."""
    decode = _engine(checkpoint, model, block_size=8, num_kv_blocks=96)
    ways = {"warm-direct": PATHS["direct"][0], "warm-flat": PATHS["flat"][0], "warm-export": PATHS["export"][0]}
    sent = {}
    for i, rid in enumerate(ways):
        prefill.prefill(rid, _prompt(100 + 10 * i, seed=40 + i))
        sent[rid] = prefill.call("export", rid)
    pairs_before = prefill.call("state")["pairs_created"]

    async def run():
        client = _client("decode-warm")
        minted: list[str] = []
        mint = client._tickets.mint

        def fresh(*claims):
            minted.append(mint(*claims))
            return minted[-1]

        client._tickets.mint = fresh  # type: ignore[method-assign]
        try:
            got = {}
            for rid, settings in ways.items():
                with prefill.configured(**settings):
                    got[rid] = await client.pull(prefill.address, rid, decode.layout)
                if rid == "warm-direct":  # the same ticket again, on the warm pair: single use holds
                    client._tickets.mint = lambda *a: minted[-1]  # type: ignore[method-assign]
                    with pytest.raises(KvTransferError) as replayed:
                        await client.pull(prefill.address, rid, decode.layout)
                    client._tickets.mint = fresh  # type: ignore[method-assign]
                    assert replayed.value.reason is FailureReason.DENIED and "replayed" in str(replayed.value)
            return got, client.stats
        finally:
            await client.close()

    got, stats = asyncio.run(run())
    assert stats.connects == 1 and stats.pulls == len(ways)
    assert prefill.call("state")["pairs_created"] - pairs_before == 1
    for rid, kv in got.items():
        assert torch.equal(kv.blocks, sent[rid]), rid
    prefill.assert_all_free()
