"""PullStream (shared/kv/transfer/pull_stream.py) against a real in-process gRPC server whose Pull handler the
test scripts: answers out of order find their pulls, a refusal fails its pull only, timeouts and a broken
stream fail as a unary Pull would."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from shared.kv.transfer import pull_stream
from shared.kv.transfer.pull_stream import PullStream
from shared.kv.transfer.rpc_calls import handler
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


@contextlib.asynccontextmanager
async def served():
    server = grpc.aio.server()

    async def serve(requests, context):
        await pull_stream.serve(scripted, requests, context)

    handlers = {"PullStream": handler(serve, pb.PullStreamRequest, pb.PullStreamReply, streaming=True)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, PullStream(pb_grpc.KvTransferStub(channel).PullStream)
    finally:
        await channel.close()
        await server.stop(0)


def pull(stream: PullStream, rid: str, timeout_s: float = 10.0, trace=()) -> asyncio.Future:
    return asyncio.ensure_future(stream.pull(pb.PullRequest(request_id=rid), trace, timeout_s))


def test_answers_in_any_order_find_their_pulls_and_carry_the_trace():
    async def run():
        async with served() as (_, stream):
            slow = pull(stream, "sleep:0.3:1", trace=(("traceparent", "slow"),))
            fast = pull(stream, "sleep:0:2", trace=(("traceparent", "fast"),))
            done, _ = await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
            assert done == {fast}  # the later request answered first
            assert (await fast).num_tokens == 2 and (await fast).dtype == "fast"
            assert (await slow).num_tokens == 1 and (await slow).dtype == "slow"
            stream.close()

    asyncio.run(run())


def test_many_pulls_at_once_each_get_their_answer():
    """Writes queue for the stream (gRPC takes one at a time), answers come back as they are ready."""

    async def run():
        async with served() as (_, stream):
            pulls = [pull(stream, f"sleep:{(i % 3) / 100}:{i}") for i in range(40)]
            assert [r.num_tokens for r in await asyncio.gather(*pulls)] == list(range(40))
            stream.close()

    asyncio.run(run())


def test_a_refusal_or_a_handler_bug_fails_its_pull_only():
    async def run():
        async with served() as (_, stream):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pull(stream, "refuse")
            assert refused.value.code() is Code.NOT_FOUND and "no KV for refuse" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as crashed:
                await pull(stream, "crash")
            assert crashed.value.code() is Code.INTERNAL and "a handler bug" in (crashed.value.details() or "")
            assert (await pull(stream, "sleep:0:3")).num_tokens == 3  # the same stream serves on
            stream.close()

    asyncio.run(run())


def test_no_answer_in_time_is_deadline_exceeded_and_the_stream_serves_on():
    async def run():
        async with served() as (_, stream):
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await pull(stream, "hang", timeout_s=0.2)
            assert late.value.code() is Code.DEADLINE_EXCEEDED
            assert (await pull(stream, "sleep:0:4")).num_tokens == 4
            stream.close()

    asyncio.run(run())


def test_a_broken_stream_fails_the_pulls_waiting_unavailable_and_later_ones_aborted():
    """A pull out when the stream broke may have started a send (UNAVAILABLE: the caller drops the pair); one
    that finds it broken was never sent (ABORTED: the caller connects again and retries it)."""

    async def run():
        async with served() as (server, stream):
            assert (await pull(stream, "sleep:0:1")).num_tokens == 1
            waiting = pull(stream, "hang")
            await asyncio.sleep(0.1)
            await server.stop(0)  # the server goes away mid-pull
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                await waiting
            assert broken.value.code() is Code.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await pull(stream, "sleep:0:1")
            assert later.value.code() is Code.ABORTED

    asyncio.run(run())


def test_closing_fails_the_pulls_waiting():
    async def run():
        async with served() as (_, stream):
            waiting = pull(stream, "hang")
            await asyncio.sleep(0.1)
            stream.close()
            with pytest.raises(grpc.aio.AioRpcError) as closed:
                await waiting
            assert closed.value.code() is Code.UNAVAILABLE and "closed" in (closed.value.details() or "")

    asyncio.run(run())


def test_closing_when_idle_lets_the_pulls_waiting_finish_and_takes_no_more():
    async def run():
        async with served() as (_, stream):
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
