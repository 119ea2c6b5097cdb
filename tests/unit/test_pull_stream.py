"""PullStream (shared/kv/transfer/pull_stream.py) against a real in-process server whose Pull handler the
test scripts, over both carriers: a gRPC PullStream call, and the same-host Unix socket (local_stream.py).
Answers out of order find their pulls, a refusal fails its pull only, timeouts and a broken stream fail as a
unary Pull would, alike on both."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from shared.kv.transfer import local_stream, pull_stream
from shared.kv.transfer.local_stream import LocalCall, LocalListener
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.rpc_calls import MAX_MESSAGE_BYTES, handler
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc

Code = grpc.StatusCode
SERVICE = "pdserve.kv.v1.KvTransfer"


async def scripted(request: pb.PullRequest, context) -> pb.PullReply:
    """request_id says what to do: "sleep:<s>:<tokens>", "refuse", "hang", "crash"; trace comes back in dtype."""
    kind, *args = request.request_id.split(":")
    if kind == "refuse":
        await context.abort(Code.NOT_FOUND, f"no KV for {request.request_id}")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "crash":
        raise RuntimeError("a handler bug")
    await asyncio.sleep(float(args[0]))
    return pb.PullReply(num_tokens=int(args[1]), dtype=dict(context.invocation_metadata()).get("traceparent", ""))


@pytest.fixture(params=["grpc", "local"])
def carrier(request) -> str:
    return request.param


@contextlib.asynccontextmanager
async def served(carrier: str):
    """(stop the server, a PullStream to it) over `carrier`."""
    if carrier == "local":
        listener = LocalListener(scripted, MAX_MESSAGE_BYTES)
        await listener.start()
        call = await LocalCall.connect(listener.name, MAX_MESSAGE_BYTES, timeout_s=5)
        try:
            yield listener.stop, PullStream(lambda: call)  # type: ignore[arg-type,return-value]
        finally:
            await listener.stop()
        return
    server = grpc.aio.server()

    async def serve(requests, context):
        try:
            await pull_stream.serve(scripted, requests, context.write, context.peer())
        except pull_stream.MessageAborted as e:
            await context.abort(e.code, e.details)

    handlers = {"PullStream": handler(serve, pb.PullStreamRequest, pb.PullStreamReply, streaming=True)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield (lambda: server.stop(0)), PullStream(pb_grpc.KvTransferStub(channel).PullStream)
    finally:
        await channel.close()
        await server.stop(0)


def pull(stream: PullStream, rid: str, timeout_s: float = 10.0, trace=()) -> asyncio.Future:
    return asyncio.ensure_future(stream.pull(pb.PullRequest(request_id=rid), trace, timeout_s))


def test_answers_in_any_order_find_their_pulls_and_carry_the_trace(carrier):
    async def run():
        async with served(carrier) as (_, stream):
            slow = pull(stream, "sleep:0.3:1", trace=(("traceparent", "slow"),))
            fast = pull(stream, "sleep:0:2", trace=(("traceparent", "fast"),))
            done, _ = await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
            assert done == {fast}  # the later request answered first
            assert (await fast).num_tokens == 2 and (await fast).dtype == "fast"
            assert (await slow).num_tokens == 1 and (await slow).dtype == "slow"
            stream.close()

    asyncio.run(run())


def test_many_pulls_at_once_each_get_their_answer(carrier):
    """Writes queue for the stream (gRPC takes one at a time), answers come back as they are ready."""

    async def run():
        async with served(carrier) as (_, stream):
            pulls = [pull(stream, f"sleep:{(i % 3) / 100}:{i}") for i in range(40)]
            assert [r.num_tokens for r in await asyncio.gather(*pulls)] == list(range(40))
            stream.close()

    asyncio.run(run())


def test_a_refusal_or_a_handler_bug_fails_its_pull_only(carrier):
    async def run():
        async with served(carrier) as (_, stream):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pull(stream, "refuse")
            assert refused.value.code() is Code.NOT_FOUND and "no KV for refuse" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as crashed:
                await pull(stream, "crash")
            assert crashed.value.code() is Code.INTERNAL and "a handler bug" in (crashed.value.details() or "")
            assert (await pull(stream, "sleep:0:3")).num_tokens == 3  # the same stream serves on
            stream.close()

    asyncio.run(run())


def test_no_answer_in_time_is_deadline_exceeded_and_the_stream_serves_on(carrier):
    async def run():
        async with served(carrier) as (_, stream):
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await pull(stream, "hang", timeout_s=0.2)
            assert late.value.code() is Code.DEADLINE_EXCEEDED
            assert (await pull(stream, "sleep:0:4")).num_tokens == 4
            stream.close()

    asyncio.run(run())


def test_a_broken_stream_fails_the_pulls_waiting_unavailable_and_later_ones_aborted(carrier):
    """A pull out when the stream broke may have started a send (UNAVAILABLE: the caller drops the pair); one
    that finds it broken was never sent (ABORTED: the caller connects again and retries it)."""

    async def run():
        async with served(carrier) as (stop, stream):
            assert (await pull(stream, "sleep:0:1")).num_tokens == 1
            waiting = pull(stream, "hang")
            await asyncio.sleep(0.1)
            await stop()  # the server goes away mid-pull
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                await waiting
            assert broken.value.code() is Code.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await pull(stream, "sleep:0:1")
            assert later.value.code() is Code.ABORTED

    asyncio.run(run())


def test_on_break_is_called_once_when_the_server_ends_the_stream_and_never_after_our_close(carrier):
    """The client forgets a pair whose stream the server ended (it stopped or died), and with it what the pair
    maps, without waiting for a pull to that address; its own close says nothing."""

    async def run():
        calls = {"theirs": 0, "ours": 0}
        async with served(carrier) as (stop, stream):
            stream.on_break = lambda: calls.__setitem__("theirs", calls["theirs"] + 1)
            assert (await pull(stream, "sleep:0:1")).num_tokens == 1  # the stream is open (opened by a pull)
            await stop()
            for _ in range(100):
                if calls["theirs"]:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        async with served(carrier) as (_, ours):
            ours.on_break = lambda: calls.__setitem__("ours", calls["ours"] + 1)
            assert (await pull(ours, "sleep:0:1")).num_tokens == 1
            ours.close()
            await asyncio.sleep(0.2)
        return calls

    assert asyncio.run(run()) == {"theirs": 1, "ours": 0}


def test_closing_fails_the_pulls_waiting(carrier):
    async def run():
        async with served(carrier) as (_, stream):
            waiting = pull(stream, "hang")
            await asyncio.sleep(0.1)
            stream.close()
            with pytest.raises(grpc.aio.AioRpcError) as closed:
                await waiting
            assert closed.value.code() is Code.UNAVAILABLE and "closed" in (closed.value.details() or "")

    asyncio.run(run())


def test_closing_when_idle_lets_the_pulls_waiting_finish_and_takes_no_more(carrier):
    async def run():
        async with served(carrier) as (_, stream):
            waiting = pull(stream, "sleep:0.3:7")
            await asyncio.sleep(0.1)
            stream.close_when_idle()
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await pull(stream, "sleep:0:1")
            assert later.value.code() is Code.ABORTED  # not sent: the caller connects again
            assert (await waiting).num_tokens == 7  # its answer came, then the stream ended
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await pull(stream, "sleep:0:1")
            assert after.value.code() is Code.ABORTED and "closed" in (after.value.details() or "")

    asyncio.run(run())


def _raw(name: str):
    return asyncio.open_unix_connection("\0" + name)


def test_local_a_message_that_is_not_a_pull_ends_its_connection_and_the_listener_serves_on():
    async def run():
        listener = LocalListener(scripted, MAX_MESSAGE_BYTES)
        await listener.start()
        try:
            for garbage in (b"\x04\x00\x00\x00\xff\xff\xff\xff", (MAX_MESSAGE_BYTES + 1).to_bytes(4, "little")):
                reader, writer = await _raw(listener.name)
                writer.write(garbage)  # a body that does not parse; then a length over the limit
                assert await asyncio.wait_for(reader.read(), 5) == b""  # ended, nothing answered
                writer.close()
            call = await LocalCall.connect(listener.name, MAX_MESSAGE_BYTES, timeout_s=5)
            stream = PullStream(lambda: call)  # type: ignore[arg-type,return-value]
            assert (await pull(stream, "sleep:0:5")).num_tokens == 5
            stream.close()
        finally:
            await listener.stop()

    asyncio.run(run())


def test_local_a_peer_of_another_user_is_refused(monkeypatch):
    """The listener serves only processes of its own user (SO_PEERCRED); here it believes it runs as another."""

    async def run():
        listener = LocalListener(scripted, MAX_MESSAGE_BYTES)
        await listener.start()
        try:
            monkeypatch.setattr(local_stream.os, "geteuid", lambda: 4242)
            call = await LocalCall.connect(listener.name, MAX_MESSAGE_BYTES, timeout_s=5)
            stream = PullStream(lambda: call)  # type: ignore[arg-type,return-value]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pull(stream, "sleep:0:1")
            assert refused.value.code() in (Code.UNAVAILABLE, Code.ABORTED)  # closed before or after our write
            assert listener.accepted == 0
        finally:
            await listener.stop()

    asyncio.run(run())


def test_local_a_name_nobody_listens_on_cannot_be_reached():
    async def run():
        with pytest.raises(OSError):
            await LocalCall.connect("pdserve-kv-0-nobody", MAX_MESSAGE_BYTES, timeout_s=5)

    asyncio.run(run())
