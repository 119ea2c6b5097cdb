"""Pulls over one long-lived gRPC stream per pair (the PullStream RPC), instead of one unary Pull call each.

Why: a unary call's setup (HTTP/2 stream, headers, deadline, completion queue hops on both sides) is most of a
small pull's fixed cost; a message on an open stream costs about half a unary round trip.
`benchmarks/kv_transfer_bench.py` prints both (its `fixed cost` line).

Each message is one Pull, handled by the server's own Pull handler through `MessageContext`, so every check
(shape, ticket and its replay cache, pair, fingerprint) is the unary call's; a refusal answers that message
with its status code and the stream goes on. The client side (`PullStream`) turns an answer's code back into
the `grpc.aio.AioRpcError` a unary Pull raises, so a caller handles both alike. Answers may come in any order
(pulls on one gloo pair run concurrently): `seq` pairs each with its request. When the stream breaks, every
pull waiting on it fails UNAVAILABLE, and the caller drops the pair, as after a unary call that failed midway;
a pull that finds it broken, never sent, fails ABORTED, so the caller connects again and retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from shared.kv.transfer.borrow import Lender
from shared.kv.transfer.rpc_calls import Unreadable
from shared.rpc import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)
# The server's unary Pull handler; its context is a grpc.aio.ServicerContext there, a MessageContext here.
PullHandler = Callable[[pb.PullRequest, Any], Awaitable[pb.PullReply]]


class MessageAborted(Exception):
    """What `MessageContext.abort` raises: the status this one message is answered with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class MessageContext:
    """The part of `grpc.aio.ServicerContext` the Pull handler uses, for one message of a stream; `lender`: the
    loans of the Unix socket connection it came over (borrow.py), None on a gRPC stream (nothing is lent there)."""

    def __init__(self, peer: str, trace: dict[str, str], lender: Lender | None = None) -> None:
        self._peer, self._trace, self.lender = peer, trace, lender

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise MessageAborted(code, details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._trace.items())

    def peer(self) -> str:
        return self._peer


async def serve(
    pull: PullHandler,
    requests: AsyncIterator[pb.PullStreamRequest | Unreadable],
    write: Callable[[pb.PullStreamReply], Awaitable[None]],
    peer: str,
    lender: Lender | None = None,
) -> None:
    """Server side: handle each message as a Pull, concurrently, writing each answer as it is ready. Returns when
    the client closes the stream; pulls still being handled then finish (their sends are the server's). Raises
    MessageAborted (INVALID_ARGUMENT) at a message that is not a pull: the caller ends the stream with it. The
    stream is a gRPC call's (server.py) or a Unix socket's (local_stream.py), whose `lender` lends blocks in
    place and takes the messages that release them (borrow.py)."""
    writing = asyncio.Lock()  # one write at a time on a gRPC stream (it refuses a second)
    tasks: set[asyncio.Task[None]] = set()

    async def answer(message: pb.PullStreamRequest) -> None:
        out = pb.PullStreamReply(seq=message.seq)
        try:
            out.reply.CopyFrom(await pull(message.pull, MessageContext(peer, dict(message.trace), lender)))
        except MessageAborted as e:
            out.code, out.details = e.code.value[0], e.details
        except Exception as e:  # a bug in a handler: that pull fails, the stream lives on
            log.exception("a streamed pull failed")
            out.code, out.details = grpc.StatusCode.INTERNAL.value[0], f"{type(e).__name__}: {e}"
        async with writing:
            with contextlib.suppress(Exception):  # the client went away: nobody to tell
                await write(out)

    async for message in requests:
        if isinstance(message, Unreadable):
            raise MessageAborted(grpc.StatusCode.INVALID_ARGUMENT, "PullStream refused: a message is not a pull")
        if message.release:  # borrowed blocks copied: no answer; a stream that lends nothing ignores it
            if lender is None:
                log.warning("a release of %r on a stream that lends nothing: ignored", message.release)
                continue
            work = lender.release(message.release)  # ends a send, which may wait for the engine: not in our way
        else:
            work = answer(message)
        task = asyncio.create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary Pull would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class PullStream:
    """Client side: one open PullStream of a pair. `pull` sends one request and waits for its answer."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open = open_call
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[pb.PullStreamReply]] = {}
        self._seq = itertools.count(1)
        self._broken: grpc.aio.AioRpcError | None = None
        self._writing = asyncio.Lock()  # gRPC takes one write at a time on a stream (TOO_MANY_OPERATIONS)
        self._closing = False  # close_when_idle was called: the stream ends with its last waiting pull
        # Called once when the stream ends other than by our close (the server stopped or died): the pair is over,
        # and what it holds (a mapped segment or pool) should go now, not at the next pull from that address.
        self.on_break: Callable[[], None] | None = None

    async def pull(self, request: pb.PullRequest, trace: tuple[tuple[str, str], ...], timeout_s: float) -> pb.PullReply:
        """The server's PullReply; raises grpc.aio.AioRpcError with the status a unary Pull would end with:
        DEADLINE_EXCEEDED past timeout_s; UNAVAILABLE when the stream broke while the pull was out (the server
        may have started its send); ABORTED when it had broken before the pull was sent (as for a pair the server
        does not know: the client connects again and retries once)."""
        if self._broken is not None:  # this pull is not sent: the caller may connect again and retry it
            raise rpc_error(grpc.StatusCode.ABORTED, f"{self._broken.details()}; connect again")
        if self._closing:
            raise rpc_error(grpc.StatusCode.ABORTED, "the pull stream is closing; connect again")
        if self._call is None:
            self._call = self._open()
            self._reader = asyncio.create_task(self._read(self._call))
        seq = next(self._seq)
        answer = self._waiting[seq] = asyncio.get_running_loop().create_future()
        try:
            try:
                async with self._writing:
                    await self._call.write(pb.PullStreamRequest(seq=seq, pull=request, trace=dict(trace)))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:  # the stream is over
                self._waiting.pop(seq, None)  # not sent, so not started: as above, the caller may retry it
                self._break(rpc_error(grpc.StatusCode.UNAVAILABLE, f"the pull stream broke: {e}"))
                raise rpc_error(grpc.StatusCode.ABORTED, f"the pull stream broke: {e}; connect again") from e
            try:
                out = await asyncio.wait_for(answer, timeout_s)
            except TimeoutError:
                late = f"no answer on the pull stream in {timeout_s} s"
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, late) from None
        finally:
            self._waiting.pop(seq, None)
            if self._closing and not self._waiting:
                self.close()
        if out.code:
            raise rpc_error(_CODES.get(out.code, grpc.StatusCode.UNKNOWN), out.details)
        return out.reply

    async def release(self, request_id: str) -> None:
        """Tell the server that the blocks it lent for `request_id` are copied (borrow.py); no answer. A stream
        that is over has nothing to tell: the server ended the loans with it."""
        if self._call is None or self._broken is not None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async with self._writing:
                await self._call.write(pb.PullStreamRequest(release=request_id))

    def close_when_idle(self) -> None:
        """End the stream once no pull waits on it; take no more pulls. The pulls waiting get their answers: the
        server handles their messages whatever we do, and a send it starts must meet its receive (or the pair's
        close), not wait out its timeout."""
        self._closing = True
        if not self._waiting:
            self.close()

    def close(self) -> None:
        """End the stream now (pulls waiting on it fail UNAVAILABLE)."""
        if self._call is not None:
            self._call.cancel()
        self._break(rpc_error(grpc.StatusCode.UNAVAILABLE, "the pull stream was closed"))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for out in call:
                answer = self._waiting.get(out.seq)
                if answer is not None and not answer.done():
                    answer.set_result(out)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the server ended the pull stream")
        except grpc.aio.AioRpcError as e:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the pull stream broke: {e.code().name} {e.details()}")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the pull stream was closed")
        ended_there = self._broken is None  # not by our close, which breaks the stream before the reader ends
        self._break(error)
        if ended_there and self.on_break is not None:
            self.on_break()

    def _break(self, error: grpc.aio.AioRpcError) -> None:
        """Fail every pull waiting on the stream, and those after, as the first break says."""
        if self._broken is None:
            self._broken = error
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(self._error())

    def _error(self) -> grpc.aio.AioRpcError:
        """A fresh copy of the break's error, for one pull to raise."""
        assert self._broken is not None
        return rpc_error(self._broken.code(), self._broken.details() or "")
