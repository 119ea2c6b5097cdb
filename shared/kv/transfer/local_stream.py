"""Same host: a pair's pulls over a Unix socket instead of the PullStream RPC (the same messages, framed).

Why: on one host the KV itself moves through the pair's shared segment (shm.py), so what is left of a pull's
cost is its control round trip, and gRPC is most of that (~0.9 ms both ways, `benchmarks/kv_pull_profile.py
--shm`). A Unix socket carries the same PullStreamRequest / PullStreamReply messages for a fraction of it
(`benchmarks/kv_transfer_bench.py` prints both: its `fixed cost` line).

What stays as it was: the pair is negotiated by the Connect RPC (ticket, proof, fingerprint), and every message
is one Pull, run through the server's own Pull handler (`pull_stream.serve`), so its checks (ticket and replay
cache, pair, fingerprint) are the gRPC stream's; the client's `PullStream` runs over a `LocalCall` as over a
gRPC call, with the same errors, so a failure here is handled as there.

Wire: each message is a 4-byte little-endian length, then the serialized message; at most `max_message_bytes`.
The socket is in the abstract namespace (`\\0pdserve-kv-<pid>-<random>`): it has no file, so nothing is left
behind when a worker is killed; it is reachable from the server's network namespace only, so a client in
another one (the veth benchmarks, a container) cannot connect and keeps the gRPC stream. The server serves a
connection only if its peer runs as the server's own user (SO_PEERCRED); that and the tickets are the checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import select
import socket
import struct
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from shared.kv.transfer.borrow import Lender
from shared.kv.transfer.pull_stream import MessageAborted, PullHandler, rpc_error, serve
from shared.kv.transfer.rpc_calls import Unreadable
from shared.rpc import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

PREFIX = "pdserve-kv-"
_LENGTH = struct.Struct("<I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _abstract(name: str) -> str:
    """The socket address of an abstract name (Linux: a leading NUL byte, no file)."""
    return "\0" + name


async def _read_message(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """One framed message; None at a clean end of stream (between messages)."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    (size,) = _LENGTH.unpack(header)
    if size > max_bytes:
        raise ValueError(f"a message of {size} bytes (at most {max_bytes})")
    return await reader.readexactly(size)


def _frame(message: pb.PullStreamRequest | pb.PullStreamReply) -> bytes:
    body = message.SerializeToString()
    return _LENGTH.pack(len(body)) + body


def _peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel saw it connect."""
    sock: socket.socket = writer.get_extra_info("socket")
    pid, uid, _gid = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid, uid


class LocalListener:
    """Server side: the abstract Unix socket a server's same-host pairs send their pulls to (one connection per
    pair; each message names its pair, as on the gRPC stream)."""

    def __init__(self, pull: PullHandler, max_message_bytes: int, lend_timeout_s: float = 30.0) -> None:
        """lend_timeout_s: how long blocks lent on a connection (borrow.py) may stay unreleased before the server
        ends that connection and takes them back."""
        self._pull = pull
        self._max = max_message_bytes
        self._lend_timeout_s = lend_timeout_s
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_urlsafe(12)}"
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.StreamWriter, Lender] = {}
        self.accepted = 0  # connections served (one per pair that took this path)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=_abstract(self.name))

    async def stop(self) -> None:
        """Stop listening and end every connection: the pulls waiting on them fail UNAVAILABLE (as when the gRPC
        server ends its streams), and their clients drop the pairs."""
        if self._server is not None:
            self._server.close()
        for writer, lender in list(self._connections.items()):
            await lender.revoke()  # the socket shut down before any lent block is freed
            writer.close()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = _peer(writer)
        if uid != os.geteuid():
            log.warning(
                "refused a local pull stream from pid %d, uid %d (this server runs as %d)", pid, uid, os.geteuid()
            )
            writer.close()
            return
        self.accepted += 1
        lender = self._connections[writer] = Lender(writer.get_extra_info("socket"), self._lend_timeout_s)

        async def write(reply: pb.PullStreamReply) -> None:
            writer.write(_frame(reply))
            await writer.drain()

        try:
            await serve(self._pull, self._requests(reader), write, f"unix:pid={pid}", lender)  # peer: for refusals
        except MessageAborted as e:  # a message that is not a pull: this connection ends, the server serves on
            log.warning("ended a local pull stream: %s", e.details)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            log.warning("a local pull stream broke: %s", e)
        finally:
            await lender.revoke()  # what is still lent: the borrower is gone, or will see the connection end
            self._connections.pop(writer, None)
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader) -> AsyncIterator[pb.PullStreamRequest | Unreadable]:
        """The connection's messages, as the gRPC stream's parser gives them (rpc_calls.handler)."""
        while (raw := await _read_message(reader, self._max)) is not None:
            try:
                yield pb.PullStreamRequest.FromString(raw)
            except DecodeError:
                yield Unreadable(pb.PullStreamRequest.__name__)


class LocalCall:
    """Client side: a connected local stream, with the surface of the `grpc.aio.StreamStreamCall` that
    `PullStream` uses (`write`, iteration, `cancel`), failing as that call would: `grpc.aio.AioRpcError`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_message_bytes: int) -> None:
        self._reader, self._writer, self._max = reader, writer, max_message_bytes
        self._ended = False  # set (on the loop) before we close the socket

    @classmethod
    async def connect(cls, name: str, max_message_bytes: int, timeout_s: float) -> LocalCall:
        """Connect to a server's local stream; OSError (or TimeoutError) when it cannot be reached from here."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(_abstract(name)), timeout_s)
        return cls(reader, writer, max_message_bytes)

    async def write(self, message: pb.PullStreamRequest) -> None:
        if self._writer.is_closing():
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the local pull stream is closed")
        try:
            self._writer.write(_frame(message))
            await self._writer.drain()
        except ConnectionError as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the local pull stream broke: {e}") from e

    def __aiter__(self) -> AsyncIterator[pb.PullStreamReply]:
        return self._replies()

    async def _replies(self) -> AsyncIterator[pb.PullStreamReply]:
        try:
            while (raw := await _read_message(self._reader, self._max)) is not None:
                yield pb.PullStreamReply.FromString(raw)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the local pull stream broke: {e}") from e
        except Exception as e:  # an answer that does not parse: the stream cannot be trusted further
            self.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the local pull stream sent garbage: {e}") from e

    def cancel(self) -> None:
        self._ended = True  # before the close: `alive` must not poll a descriptor number reused since
        with contextlib.suppress(RuntimeError):  # the loop is closed already: the socket went with it
            self._writer.close()

    def alive(self) -> bool:
        """Whether the connection is still up, read now from any thread: False once we closed it or the server
        shut it down (then the blocks it lent may be freed: borrow.py). A poll of the socket, no loop turn."""
        if self._ended or self._writer.is_closing():
            return False
        sock = self._writer.get_extra_info("socket")
        fd = -1 if sock is None else sock.fileno()
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        over = bool(poller.poll(0))
        return not over and not self._ended
