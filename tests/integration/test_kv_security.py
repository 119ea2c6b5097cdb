"""Who may use the KV transfer plane: signed tickets, and calls sent straight to the server.

Tickets first (mint / verify, every refusal reason), then a real KvTransferServer over an engine holding
KV, called with raw gRPC: no ticket, a forged, expired, replayed, another worker's or another request's one,
garbage bytes, empty and oversized fields, an unknown backend, a wrong fingerprint, an unknown request.
Every call gets an error status; after each the server still serves a valid pull, the refused KV is still
held and the pool passes check_integrity(). Then single use (ReplayCache; replayed pull and connect tickets)
and the rendezvous (a stranger who reads the store, scribbles in it and joins a pair; pair ids). Server and
puller share this process (the gloo pair joins over loopback as between two processes). TLS: test_kv_tls.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.replay import ReplayCache
from shared.kv.tickets import MAX_TICKET_CHARS, TicketError, TicketReason, Tickets
from shared.kv.transfer import EngineKvBlocks, FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer import server as server_module
from shared.kv.transfer.local_stream import LocalCall
from shared.kv.transfer.pair import DECODE_RANK, Pair, TransferBackend, store_client
from shared.kv.transfer.pair_proof import PairProofs, PairRefused
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES
from shared.kv.transfer.server import MAX_ID_CHARS, SERVICE
from shared.kv.transfer.wire import pieces
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc

SECRET = b"security-test-cluster-secret"
TICKETS = Tickets(SECRET)
FORGER = Tickets(b"some-other-cluster-secret")
TIMEOUT_S = 20.0
LEASE_S = 600.0  # held KV outlives every test here: only pulls free it
ENGINE_OPTS = dict(num_kv_blocks=32, max_model_len=256, scheduler=SchedulerConfig(max_num_batched_tokens=128))
MODEL_NAME = "security-test"
Code = grpc.StatusCode


# ---- tickets ----------------------------------------------------------------------------------------------


def _reason(ticket: str, worker: str, request: str | None = None, **kwargs) -> TicketReason | None:
    try:
        TICKETS.verify(ticket, worker, request, **kwargs)
    except TicketError as e:
        assert ticket not in str(e) or not ticket, "a refusal must not repeat the ticket"
        return e.reason
    return None


def test_a_ticket_grants_one_worker_one_request_until_it_expires():
    now = time.time()
    pull = TICKETS.mint("decode-a", "req-1", now=now)
    connect = TICKETS.mint("decode-a", now=now)
    assert _reason(pull, "decode-a", "req-1") is None and _reason(connect, "decode-a") is None
    assert _reason(pull, "decode-b", "req-1") is TicketReason.WRONG_WORKER
    assert _reason(pull, "decode-a", "req-2") is TicketReason.WRONG_REQUEST
    assert _reason(pull, "decode-a") is TicketReason.WRONG_REQUEST  # a pull ticket does not connect
    assert _reason(connect, "decode-a", "req-1") is TicketReason.WRONG_REQUEST  # nor the reverse
    # Expiry: lifetime plus the skew allowance, measured on the verifier's clock.
    life, skew = TICKETS.lifetime_s, TICKETS.skew_s
    assert _reason(pull, "decode-a", "req-1", now=now + life + skew - 1) is None
    assert _reason(pull, "decode-a", "req-1", now=now + life + skew + 1) is TicketReason.EXPIRED


def test_forged_tampered_and_malformed_tickets_are_told_apart():
    pull = TICKETS.mint("decode-a", "req-1")
    version, claims, mac = pull.split(".")
    other_claims = TICKETS.mint("decode-a", "req-2").split(".")[1]
    cases = {
        "": TicketReason.MISSING,
        "not a ticket": TicketReason.MALFORMED,
        f"v1.{claims}.{mac}": TicketReason.MALFORMED,  # the version before nonces
        f"v3.{claims}.{mac}": TicketReason.MALFORMED,
        f"{version}.{claims}.{mac}=": TicketReason.MALFORMED,  # one spelling per ticket: no padding
        f"{version}.{claims}.{mac}.x": TicketReason.MALFORMED,
        f"{version}.{claims}.{mac[:-1]}é": TicketReason.MALFORMED,
        "v2." + "A" * MAX_TICKET_CHARS: TicketReason.MALFORMED,
        FORGER.mint("decode-a", "req-1"): TicketReason.FORGED,  # signed with another secret
        f"{version}.{other_claims}.{mac}": TicketReason.FORGED,  # claims swapped under a real signature
        f"{version}.{claims}.{mac[:-2]}AA": TicketReason.FORGED,
    }
    for ticket, reason in cases.items():
        assert _reason(ticket, "decode-a", "req-1") is reason, ticket[:60]


def test_tickets_need_a_real_secret_and_ids():
    for short in (b"", b"x" * 15, "fifteen-chars!!", None):
        with pytest.raises(ValueError, match="at least 16 bytes"):
            Tickets(short)
    assert Tickets("s" * 16).mint("w")  # a str secret is taken as UTF-8
    with pytest.raises(ValueError):
        TICKETS.mint("")
    with pytest.raises(ValueError):
        TICKETS.mint("w", "")


# ---- a server holding KV ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Prefill:
    engine: Engine
    source: HeldKv
    server: KvTransferServer
    address: str
    channel: grpc.aio.Channel

    async def hold(self, rid: str, tokens: int = 40) -> None:
        prompt = torch.randint(0, 259, (tokens,), generator=torch.Generator().manual_seed(len(rid))).tolist()
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
        while self.engine.has_unfinished():
            self.engine.step()
        assert await self.source.hold(rid, rid, 0)

    def assert_holds(self, *rids: str) -> None:
        """Exactly `rids` held, their blocks still allocated, and the pool consistent."""
        self.engine.check_integrity()
        assert sorted(self.source.keys()) == sorted(rids)
        assert (self.engine.blocks.num_free == self.engine.blocks.num_blocks) == (not rids)

    async def settle(self, *rids: str) -> None:
        """Wait until only `rids` are held (a release follows the send, so it may lag the recv)."""
        deadline = time.monotonic() + 10
        while sorted(self.source.keys()) != sorted(rids) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.assert_holds(*rids)

    async def raw(self, method: str, payload: bytes) -> tuple[Code, str]:
        """Call a method with raw bytes (no serializer on either side): its status code and details."""
        try:
            await self.channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return Code.OK, ""

    async def call(self, method: str, **fields) -> tuple[Code, str]:
        message = pb.PullRequest(**fields) if method == "Pull" else pb.ConnectRequest(**fields)
        return await self.raw(method, message.SerializeToString())

    def connect_fields(self, worker: str, **changes) -> dict:
        fields = dict(
            decode_worker_id=worker,
            backend=pb.BACKEND_GLOO,
            layout_fingerprint=self.engine.layout.fingerprint,
            ticket=TICKETS.mint(worker),
        )
        return fields | changes

    async def open_pair(self, worker: str) -> Pair:
        """Connect as `worker` and join the pair's decode rank, as KvTransferClient does."""
        reply = await pb_grpc.KvTransferStub(self.channel).Connect(pb.ConnectRequest(**self.connect_fields(worker)))
        return await join_pair(reply, SECRET)

    def pull_fields(self, rid: str, worker: str, pair: Pair, **changes) -> dict:
        fields = dict(
            request_id=rid,
            decode_worker_id=worker,
            pair_id=pair.pair_id,
            layout_fingerprint=self.engine.layout.fingerprint,
            ticket=TICKETS.mint(worker, rid),
        )
        return fields | changes

    async def pull_with(self, client: KvTransferClient, rid: str) -> int:
        kv = await client.pull(self.address, rid, self.engine.layout)
        return kv.num_tokens


async def join_pair(reply: pb.ConnectReply, secret: bytes) -> Pair:
    """Join the decode rank of the pair `reply` names and exchange proofs under `secret`, as the client does."""

    def join() -> Pair:
        store = store_client(reply.store_host, reply.store_port, TIMEOUT_S)
        pair = Pair.join(TransferBackend.GLOO, store, reply.pair_id, DECODE_RANK, TIMEOUT_S, "127.0.0.1")
        PairProofs(secret).confirm(pair)
        return pair

    return await asyncio.to_thread(join)


@contextlib.asynccontextmanager
async def serving(checkpoint, model, **server_options):
    engine = Engine.build(EngineConfig(model=str(checkpoint), **ENGINE_OPTS), model)
    source = HeldKv(EngineKvBlocks(engine), lease_s=LEASE_S)
    server = KvTransferServer(
        "127.0.0.1",
        0,
        source,
        secret=SECRET,
        timeout_s=TIMEOUT_S,
        chunk_bytes=4096,
        model_name=MODEL_NAME,
        **server_options,
    )
    address = await server.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield Prefill(engine, source, server, address, channel)
    finally:
        await channel.close()
        await server.stop()


def _client(worker: str, secret: bytes = SECRET, local_stream: bool = True) -> KvTransferClient:
    return KvTransferClient(worker, secret=secret, timeout_s=TIMEOUT_S, local_stream=local_stream)


# The two carriers of a pair's pulls: the PullStream RPC, and (same host, here) the server's Unix socket.
CARRIERS = pytest.mark.parametrize("local_stream", [False, True], ids=["grpc-stream", "local-stream"])


def _refusals(reason: str) -> float:
    labels = dict(model_name=MODEL_NAME, role="prefill", reason=reason)
    return REGISTRY.get_sample_value("pdserve:kv_transfer_failures_total", labels) or 0.0


# ---- pulls ------------------------------------------------------------------------------------------------


def test_pulls_without_a_valid_ticket_are_refused_and_leave_the_kv_held(checkpoint, model, caplog):
    caplog.set_level(logging.WARNING, logger="shared.kv.transfer.server")

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            pair = await p.open_pair("decode-a")
            forged = FORGER.mint("decode-a", "r")
            version, _, mac = TICKETS.mint("decode-a", "r").split(".")
            tampered = ".".join((version, TICKETS.mint("decode-a", "other").split(".")[1], mac))
            refusals = {  # ticket → (status, metric reason)
                "": (Code.UNAUTHENTICATED, "ticket_missing"),
                "letmein": (Code.UNAUTHENTICATED, "ticket_malformed"),
                forged: (Code.PERMISSION_DENIED, "ticket_forged"),
                tampered: (Code.PERMISSION_DENIED, "ticket_forged"),
                TICKETS.mint("decode-a", "r", now=time.time() - 120): (Code.PERMISSION_DENIED, "ticket_expired"),
                TICKETS.mint("decode-b", "r"): (Code.PERMISSION_DENIED, "ticket_wrong_worker"),
                TICKETS.mint("decode-a", "other"): (Code.PERMISSION_DENIED, "ticket_wrong_request"),
                TICKETS.mint("decode-a"): (Code.PERMISSION_DENIED, "ticket_wrong_request"),  # a connect ticket
            }
            for ticket, (code, reason) in refusals.items():
                before = _refusals(reason)
                got, details = await p.call("Pull", **p.pull_fields("r", "decode-a", pair, ticket=ticket))
                assert got is code, (reason, got, details)
                assert "refused" in details and _refusals(reason) == before + 1
                p.assert_holds("r")
            assert p.server.stats.refused == len(refusals) and p.server.stats.pulls == 0
            # The log names the reason, never the ticket.
            assert "ticket forged" in caplog.text and forged not in caplog.text and tampered not in caplog.text

            # Valid tickets, other refusals: another worker's pair, another layout, a request not held.
            got, _ = await p.call("Pull", **p.pull_fields("r", "decode-b", pair))
            assert got is Code.ABORTED  # decode-b presents decode-a's pair
            got, _ = await p.call("Pull", **p.pull_fields("r", "decode-a", pair, layout_fingerprint="wrong"))
            assert got is Code.FAILED_PRECONDITION
            got, _ = await p.call("Pull", **p.pull_fields("ghost", "decode-a", pair))
            assert got is Code.NOT_FOUND
            p.assert_holds("r")

            # The right worker pulls with a valid ticket on its own pair, then replays that ticket.
            fields = p.pull_fields("r", "decode-a", pair)
            reply = pb.PullReply.FromString(
                await p.channel.unary_unary(f"/{SERVICE}/Pull")(pb.PullRequest(**fields).SerializeToString())
            )
            received = torch.empty(tuple(reply.shape), dtype=p.engine.layout.torch_dtype)
            await asyncio.to_thread(pair.recv, pieces(received, reply.chunk_bytes), reply.tag)
            assert reply.num_tokens == 40 and len(pieces(received, reply.chunk_bytes)) > 1
            await p.settle()
            got, details = await p.call("Pull", **fields)
            assert got is Code.PERMISSION_DENIED and "replayed" in details  # a ticket is good for one call
            fields["ticket"] = TICKETS.mint("decode-a", "r")
            got, _ = await p.call("Pull", **fields)
            assert got is Code.NOT_FOUND  # a fresh ticket finds nothing: the pull freed the KV
            pair.close()
            p.assert_holds()

    asyncio.run(run())


@CARRIERS
def test_streamed_pulls_are_checked_as_unary_ones_and_a_refusal_ends_only_its_message(checkpoint, model, local_stream):
    """The PullStream a client pulls over (pull_stream.py), on either carrier: every message passes the Pull's
    checks. Knowing the local socket's name gets a process nothing without valid tickets."""

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            pair = await p.open_pair("decode-a")
            local = p.server._local
            assert local is not None
            if local_stream:
                call = await LocalCall.connect(local.name, MAX_MESSAGE_BYTES, TIMEOUT_S)
                stream = PullStream(lambda: call)  # pyright: ignore[reportArgumentType]
            else:
                stream = PullStream(pb_grpc.KvTransferStub(p.channel).PullStream)

            async def pull(**changes) -> pb.PullReply:
                return await stream.pull(
                    pb.PullRequest(**p.pull_fields("r", "decode-a", pair, **changes)), (), TIMEOUT_S
                )

            refusals = {  # changed fields → status, each on the same stream
                "forged": ({"ticket": FORGER.mint("decode-a", "r")}, Code.PERMISSION_DENIED),
                "no ticket": ({"ticket": ""}, Code.UNAUTHENTICATED),
                "another worker": (
                    {"decode_worker_id": "decode-b", "ticket": TICKETS.mint("decode-b", "r")},
                    Code.ABORTED,
                ),
                "layout": ({"layout_fingerprint": "wrong"}, Code.FAILED_PRECONDITION),
                "unknown request": (
                    {"request_id": "ghost", "ticket": TICKETS.mint("decode-a", "ghost")},
                    Code.NOT_FOUND,
                ),
            }
            for what, (changes, code) in refusals.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pull(**changes)
                assert refused.value.code() is code, (what, refused.value.details())
            p.assert_holds("r")

            ticket = TICKETS.mint("decode-a", "r")
            reply = await pull(ticket=ticket)  # the stream outlived every refusal
            received = torch.empty(tuple(reply.shape), dtype=p.engine.layout.torch_dtype)
            await asyncio.to_thread(pair.recv, pieces(received, reply.chunk_bytes), reply.tag)
            assert reply.num_tokens == 40
            await p.settle()
            with pytest.raises(grpc.aio.AioRpcError) as replayed:
                await pull(ticket=ticket)
            assert replayed.value.code() is Code.PERMISSION_DENIED and "replayed" in (replayed.value.details() or "")
            stream.close()

            # A message that is not a pull ends that stream (gRPC: INVALID_ARGUMENT); the server serves on.
            if local_stream:
                reader, writer = await asyncio.open_unix_connection("\0" + local.name)
                writer.write(b"\x03\x00\x00\x00\xff\xff\xff")
                assert await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""
                writer.close()
            else:
                raw = p.channel.stream_stream(f"/{SERVICE}/PullStream")()
                await raw.write(b"\xff\xff\xff")
                assert await raw.code() is Code.INVALID_ARGUMENT
            assert p.server.stats.pulls == 1
            pair.close()
            p.assert_holds()

    asyncio.run(run())


@pytest.mark.parametrize("shared_memory", [False, True], ids=["socket", "shm"])
def test_a_pull_cancelled_before_its_answer_leaves_nothing_stuck(checkpoint, model, monkeypatch, shared_memory):
    """The server handles a streamed pull whose caller gave up: the client closes that pair, so a send the
    message started fails at once instead of waiting out its timeout, and the KV is pulled on a new pair."""

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            await p.hold("s")
            accept = p.server._accept

            async def slow_accept(*args):
                await asyncio.sleep(0.5)  # the caller is gone before the answer
                return await accept(*args)

            client = KvTransferClient("decode-a", secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=shared_memory)
            try:
                assert await p.pull_with(client, "s") == 40  # the pair and its stream are up
                monkeypatch.setattr(p.server, "_accept", slow_accept)
                pulling = asyncio.create_task(client.pull(p.address, "r", p.engine.layout))
                await asyncio.sleep(0.2)
                pulling.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pulling
                monkeypatch.setattr(p.server, "_accept", accept)
                await asyncio.sleep(1.0)  # the message handled; had it started a send, the closed pair failed it
                assert not p.source.is_sending("r")
                if "r" in p.source.keys():  # not sent (the handler gave up on the closed stream): pull it again
                    assert await p.pull_with(client, "r") == 40
                    assert client.stats.connects == 2  # on a new pair
                await p.settle()
            finally:
                await client.close()

    asyncio.run(run())


@CARRIERS
def test_stop_ends_open_pull_streams_instead_of_waiting_out_its_grace(checkpoint, model, local_stream):
    """A decode worker keeps its PullStream open for good: the server's stop ends it (UNAVAILABLE)."""

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            client = _client("decode-a", local_stream=local_stream)
            try:
                assert await p.pull_with(client, "r") == 40  # the client's PullStream stays open
                assert client.stats.local_pulls == local_stream
                # A grace the stop must not wait out (an open stream would hold it that long).
                await asyncio.wait_for(p.server.stop(grace_s=600), 60)
                with pytest.raises(KvTransferError):  # the stream ended with the server
                    await client.pull(p.address, "r", p.engine.layout)
            finally:
                await client.close()

    asyncio.run(run())


@CARRIERS
def test_a_pull_stream_that_broke_between_pulls_is_replaced_transparently(checkpoint, model, local_stream):
    """The stream ends under an idle pair (here the server aborts it; a network blip alike): the next pull,
    never sent on it, connects again and goes through."""

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            await p.hold("s")
            client = _client("decode-a", local_stream=local_stream)
            try:
                assert await p.pull_with(client, "r") == 40
                if local_stream:
                    local = p.server._local
                    assert local is not None
                    (connection,) = local._connections
                    connection.close()
                else:
                    (stream,) = p.server._streams
                    with contextlib.suppress(Exception):
                        await stream.abort(Code.UNAVAILABLE, "gone")
                await asyncio.sleep(0.2)  # the client's reader sees the end
                assert await p.pull_with(client, "s") == 40
                assert client.stats.connects == 2 and p.server.stats.pulls == 2
                assert client.stats.local_pulls == 2 * local_stream
                await p.settle()
            finally:
                await client.close()

    asyncio.run(run())


def test_connects_without_a_valid_ticket_open_no_pair(checkpoint, model):
    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            refusals = {
                "": Code.UNAUTHENTICATED,
                "v1.x.y": Code.UNAUTHENTICATED,
                FORGER.mint("decode-a"): Code.PERMISSION_DENIED,
                TICKETS.mint("decode-a", now=time.time() - 120): Code.PERMISSION_DENIED,
                TICKETS.mint("decode-b"): Code.PERMISSION_DENIED,
                TICKETS.mint("decode-a", "r"): Code.PERMISSION_DENIED,  # a pull ticket does not connect
            }
            for ticket, code in refusals.items():
                got, details = await p.call("Connect", **p.connect_fields("decode-a", ticket=ticket))
                assert got is code, (ticket[:40], got, details)
            # Valid tickets, but what the server cannot do.
            bad_fields = [
                (dict(backend=7), Code.INVALID_ARGUMENT),  # not a TransferBackend value at all
                (dict(backend=pb.BACKEND_UNSPECIFIED), Code.INVALID_ARGUMENT),
                (dict(backend=pb.BACKEND_NCCL), Code.FAILED_PRECONDITION),
                (dict(layout_fingerprint="another-model"), Code.FAILED_PRECONDITION),
            ]
            for changes, code in bad_fields:
                got, details = await p.call("Connect", **p.connect_fields("decode-a", **changes))
                assert got is code, (changes, got, details)
            assert p.server.stats.pairs_created == 0 and p.server.num_pairs == 0
            p.assert_holds("r")

            client = _client("decode-a")
            try:
                assert await p.pull_with(client, "r") == 40
            finally:
                await client.close()
            await p.settle()

    asyncio.run(run())


def test_a_client_with_another_secret_is_denied_and_the_right_one_pulls(checkpoint, model):
    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            before = _refusals("ticket_forged")
            impostor, honest = _client("decode-a", secret=b"some-other-cluster-secret"), _client("decode-a")
            try:
                with pytest.raises(KvTransferError) as denied:
                    await p.pull_with(impostor, "r")
                assert denied.value.reason is FailureReason.DENIED
                assert _refusals("ticket_forged") == before + 1  # its Connect, refused before any pair
                p.assert_holds("r")
                assert await p.pull_with(honest, "r") == 40
            finally:
                await impostor.close()
                await honest.close()
            await p.settle()

    asyncio.run(run())


# ---- malformed calls --------------------------------------------------------------------------------------


def test_malformed_calls_get_an_error_status_and_the_server_keeps_serving(checkpoint, model):
    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            long_id = "x" * (MAX_ID_CHARS + 1)
            calls = [  # (method, payload, expected status)
                ("Pull", b"\xff\xfe garbage \x00\x01", Code.INVALID_ARGUMENT),
                ("Connect", b"\xff\xfe garbage \x00\x01", Code.INVALID_ARGUMENT),
                ("Pull", b"", Code.INVALID_ARGUMENT),  # parses as all fields empty
                ("Connect", b"", Code.INVALID_ARGUMENT),
                ("Pull", b"\x0a\x02\xff\xfe", Code.INVALID_ARGUMENT),  # request_id that is not UTF-8
                ("Pull", pb.PullRequest(request_id=long_id, decode_worker_id="d", pair_id="p").SerializeToString(),
                 Code.INVALID_ARGUMENT),
                ("Connect", pb.ConnectRequest(decode_worker_id=long_id).SerializeToString(), Code.INVALID_ARGUMENT),
                ("Pull", pb.PullRequest(request_id="r", decode_worker_id="d", pair_id="p",
                                        ticket="v1." + "A" * 50_000).SerializeToString(), Code.UNAUTHENTICATED),
                ("Pull", pb.PullRequest(request_id="r" * 200_000).SerializeToString(), Code.RESOURCE_EXHAUSTED),
            ]  # fmt: skip
            for method, payload, code in calls:
                got, details = await p.raw(method, payload)
                assert got is code, (method, payload[:20], got, details)
            rng = random.Random(6)
            for _ in range(100):  # random bytes: unreadable, or readable with empty ids or no ticket
                payload = rng.randbytes(rng.randrange(1, 200))
                for method in ("Pull", "Connect"):
                    got, details = await p.raw(method, payload)
                    assert got in (Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED), (method, payload, got, details)
            for path in (f"/{SERVICE}/Steal", "/pdserve.KvTransfer/Pull"):
                try:
                    await p.channel.unary_unary(path)(b"", timeout=TIMEOUT_S)
                except grpc.aio.AioRpcError as e:
                    assert e.code() is Code.UNIMPLEMENTED
                else:
                    pytest.fail(f"{path} answered")
            assert p.server.stats.pairs_created == 0 and p.server.stats.pulls == 0
            p.assert_holds("r")

            client = _client("decode-a")
            try:
                assert await p.pull_with(client, "r") == 40
            finally:
                await client.close()
            await p.settle()

    asyncio.run(run())


# ---- single use -------------------------------------------------------------------------------------------


def test_the_replay_cache_admits_a_ticket_once_until_it_expires_and_refuses_when_full():
    now = time.time()
    a, b, c = (
        TICKETS.verify(TICKETS.mint("decode-a", f"r{i}", now=now), "decode-a", f"r{i}", now=now) for i in range(3)
    )
    assert len({a.nonce, b.nonce, c.nonce}) == 3  # same worker, same second: still three tickets
    assert (
        TICKETS.verify(TICKETS.mint("d", "r", now=now), "d", "r", now=now).nonce
        != TICKETS.verify(TICKETS.mint("d", "r", now=now), "d", "r", now=now).nonce
    )
    cache = ReplayCache(capacity=2, skew_s=TICKETS.skew_s)
    cache.admit(a, now=now)
    with pytest.raises(TicketError) as replayed:
        cache.admit(a, now=now + 1)
    assert replayed.value.reason is TicketReason.REPLAYED
    cache.admit(b, now=now)
    with pytest.raises(TicketError) as full:  # two live entries: refused, not an early forgetting
        cache.admit(c, now=now + 1)
    assert full.value.reason is TicketReason.OVERLOADED and len(cache) == 2
    with pytest.raises(TicketError):  # within lifetime + skew, `a` is still remembered
        cache.admit(a, now=a.expires_s + TICKETS.skew_s - 0.5)
    cache.admit(c, now=a.expires_s + TICKETS.skew_s + 0.5)  # a and b expired (and verify would refuse them)
    assert len(cache) == 1
    with pytest.raises(ValueError):
        ReplayCache(capacity=0)


def test_replayed_pull_and_connect_tickets_are_refused_and_the_kv_stays_pullable(checkpoint, model, caplog):
    caplog.set_level(logging.WARNING, logger="shared.kv.transfer.server")

    async def run():
        async with serving(checkpoint, model) as p:
            await p.hold("r")
            connect = p.connect_fields("decode-a")
            assert (await p.call("Connect", **connect))[0] is Code.OK
            before = _refusals("ticket_replayed")
            got, details = await p.call("Connect", **connect)  # the same connect ticket again
            assert got is Code.PERMISSION_DENIED and "replayed" in details, (got, details)
            assert p.server.stats.pairs_created == 1 and _refusals("ticket_replayed") == before + 1

            pair = await p.open_pair("decode-a")
            fields = p.pull_fields("r", "decode-a", pair, layout_fingerprint="not-ours")
            # Accepted ticket, refused call (wrong fingerprint): the ticket is spent all the same.
            assert (await p.call("Pull", **fields))[0] is Code.FAILED_PRECONDITION
            got, details = await p.call("Pull", **fields | {"layout_fingerprint": p.engine.layout.fingerprint})
            assert got is Code.PERMISSION_DENIED and "replayed" in details
            assert _refusals("ticket_replayed") == before + 2
            p.assert_holds("r")
            assert fields["ticket"] not in caplog.text and "ticket replayed" in caplog.text
            pair.close()

            client = _client("decode-a")  # mints a fresh ticket per call, and for its retry on a new pair
            try:
                assert await p.pull_with(client, "r") == 40
            finally:
                await client.close()
            await p.settle()

    asyncio.run(run())


def test_a_full_replay_cache_refuses_calls_instead_of_forgetting_tickets(checkpoint, model):
    async def run():
        async with serving(checkpoint, model, replay_capacity=2) as p:
            await p.hold("r")
            first = p.connect_fields("decode-a")
            for fields in (first, p.connect_fields("decode-a")):
                assert (await p.call("Connect", **fields))[0] is Code.OK
            before = _refusals("ticket_overloaded")
            got, details = await p.call("Connect", **p.connect_fields("decode-a"))
            assert got is Code.RESOURCE_EXHAUSTED and "overloaded" in details
            got, details = await p.call("Connect", **first)  # still remembered: a replay, not a fresh ticket
            assert got is Code.PERMISSION_DENIED and "replayed" in details
            assert _refusals("ticket_overloaded") == before + 1 and p.server.stats.pairs_created == 2
            p.assert_holds("r")

    asyncio.run(run())


# ---- the rendezvous ---------------------------------------------------------------------------------------


def test_a_stranger_in_the_rendezvous_store_gets_no_pair_and_breaks_none(checkpoint, model):
    """The store answers anyone: list its keys, scribble random ones, join a pair found there as its decode
    rank. The pair's proof exchange refuses the stranger; honest pulls before and after go through."""

    async def run():
        async with serving(checkpoint, model) as p:
            for rid in ("r1", "r2", "r3"):
                await p.hold(rid)
            honest = _client("decode-a")
            try:
                assert await p.pull_with(honest, "r1") == 40
                stranger = store_client("127.0.0.1", p.server._store.port, TIMEOUT_S)  # pyright: ignore
                rng = random.Random(15)
                for key in stranger.list_keys() + [f"decode-a/{rng.randbytes(8).hex()}" for _ in range(50)]:
                    stranger.set(f"{key}{rng.choice(['', '/rank_1', '/0'])}", rng.randbytes(rng.randrange(1, 64)))
                    stranger.add(f"{key}/counter", rng.randrange(1, 10))
                assert await p.pull_with(honest, "r2") == 40  # the pair in use is untouched

                # A pair id is unguessable, but the store lists it: a stranger who joins first gets refused.
                reply = await pb_grpc.KvTransferStub(p.channel).Connect(pb.ConnectRequest(**p.connect_fields("d-b")))
                assert len(reply.pair_id.split("/")[1]) >= 32
                deadline = time.monotonic() + 10  # the server's rank writes its keys as it starts joining
                while reply.pair_id not in str(stranger.list_keys()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert reply.pair_id in str(stranger.list_keys())
                before = _refusals("pair_refused")
                with pytest.raises(PairRefused):  # the server closed the pair on our wrong proof
                    await join_pair(reply, b"the-stranger-guesses-a-secret")
                deadline = time.monotonic() + 10
                while _refusals("pair_refused") == before and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert _refusals("pair_refused") == before + 1
                assert p.server.num_pairs == 1  # decode-a's; decode-b's was dropped
                p.assert_holds("r3")
                assert await p.pull_with(honest, "r3") == 40
            finally:
                await honest.close()
            await p.settle()

    asyncio.run(run())


def test_pair_ids_are_never_handed_out_twice(checkpoint, model, monkeypatch):
    async def run():
        async with serving(checkpoint, model) as p:
            first = await pb_grpc.KvTransferStub(p.channel).Connect(pb.ConnectRequest(**p.connect_fields("d")))
            assert (await p.call("Connect", **p.connect_fields("d")))[0] is Code.OK
            monkeypatch.setattr(server_module.secrets, "token_urlsafe", lambda n: first.pair_id.split("/")[1])
            got, details = await p.call("Connect", **p.connect_fields("d"))
            assert got is Code.INTERNAL and "twice" in details
            assert p.server.stats.pairs_created == 2

    asyncio.run(run())
