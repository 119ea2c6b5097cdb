"""Same host, one copy: a decode worker borrows a request's blocks in the prefill worker's pool, in place.

The prefill pool lives in a memfd (shared/engine/shared_pool.py) that the decode side maps read-only at Connect.
A pull that asks to borrow, over the pair's Unix socket (local_stream.py), is answered with the request's block
ids instead of bytes; the decode import copies those blocks straight into its own pool
(shared/engine/borrowed_kv.py) and then sends a release message on the same socket. Through the pair's segment
the same hand-off costs two copies (the gather into the segment, then the import).

The rule that makes it safe: **the server ends a connection before it frees a block lent on it.** A loan ends by
- its release message: the decode side has copied the blocks (the send ends well, the blocks are freed);
- the connection's end (the decode worker closed it, dropped its pair, or died);
- `timeout_s` without a release, or the server stopping: the server shuts the socket down first.
The decode side trusts a copy only if its connection was still up when the copy ended (`LocalCall.alive`, a
poll of the socket: a shutdown by the server shows at once), so it never imports blocks that were freed and
reused under it: it recomputes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from shared.engine.shared_pool import HEADER_BYTES, PoolHandle
from shared.rpc import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

EndLoan = Callable[[bool], Awaitable[None]]  # ends the loan's send: ok=True once released, False when revoked


class Lender:
    """The loans made on one local connection, and the one way they end early: ending the connection first."""

    def __init__(self, sock: socket.socket | None, timeout_s: float) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self._loans: dict[str, tuple[EndLoan, asyncio.TimerHandle]] = {}
        self.revoked = False
        self._revoking: asyncio.Task[None] | None = None  # a timeout's revoke, running
        self.lent = 0  # loans made on this connection
        self.released = 0  # of which ended by the borrower's release message

    def lend(self, request_id: str, end: EndLoan) -> None:
        """Keep `request_id`'s send open until its release; revoke the whole connection past `timeout_s`."""
        if self.revoked:
            raise RuntimeError("this connection is over: nothing more is lent on it")
        if request_id in self._loans:  # a source sends a request once at a time (ALREADY_EXISTS): never here
            raise RuntimeError(f"{request_id!r} is lent on this connection already")
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expired, request_id)
        self._loans[request_id] = (end, timer)
        self.lent += 1

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loans

    async def release(self, request_id: str) -> None:
        """The borrower copied the blocks: the send is over. A release of nothing lent is ignored (logged)."""
        loan = self._loans.pop(request_id, None)
        if loan is None:
            log.warning("a release of %r, which is not lent on this connection: ignored", request_id)
            return
        end, timer = loan
        timer.cancel()
        self.released += 1
        await end(True)

    async def revoke(self) -> None:
        """End the connection, then every loan on it (their blocks may be freed once the borrower can see the
        connection is over). Idempotent."""
        self.revoked = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # now, not at the transport's next loop turn
        loans, self._loans = self._loans, {}
        for end, timer in loans.values():
            timer.cancel()
            await end(False)

    def _expired(self, request_id: str) -> None:
        log.warning("KV lent for %r was not released within %.0f s: ending its connection", request_id, self._timeout_s)
        if self._revoking is None:
            self._revoking = asyncio.ensure_future(self.revoke())


def pool_memory(handle: PoolHandle) -> pb.PoolMemory:
    """The Connect reply's description of the pool (the decode side maps it with `attach_pool`)."""
    return pb.PoolMemory(
        pid=handle.pid, fd=handle.fd, nbytes=handle.nbytes, nonce=handle.nonce, num_blocks=handle.num_blocks,
        header_bytes=HEADER_BYTES,
    )  # fmt: skip


def pool_handle(message: pb.PoolMemory) -> PoolHandle:
    """The pool a Connect reply describes. ValueError for a layout this version does not map (another header)."""
    if message.header_bytes != HEADER_BYTES:
        raise ValueError(f"a pool header of {message.header_bytes} bytes (this version maps {HEADER_BYTES})")
    return PoolHandle(message.pid, message.fd, message.nbytes, message.nonce, message.num_blocks)
