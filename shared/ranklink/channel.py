"""The local channels between a group's leader and its followers (one host): loopback TCP, a random token.

The leader listens (`ChannelServer`) before it spawns its followers and hands them (host, port, token); each
follower dials three times, naming its rank and the channel's purpose: "ops" (the step loop's op headers),
"agent" (rank-agent calls, the leader asking) and "events" (a rank's reports to the leader, e.g. a KV send that
ended: the follower telling). Frames: a 4-byte big-endian length, then a pickle. A closed socket reads as None: a
follower whose leader died sees it at once, without any timeout.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

_LEN = struct.Struct(">I")
PURPOSES = ("ops", "agent", "events")  # the channels each follower dials


@dataclass(frozen=True)
class ChannelAddress:
    host: str
    port: int
    token: str = field(repr=False)


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> Any | None:
    """The next frame's object; None when the peer closed the connection (or it broke)."""
    try:
        head = _recv_exact(sock, _LEN.size)
        if head is None:
            return None
        body = _recv_exact(sock, _LEN.unpack(head)[0])
    except OSError:
        return None
    return None if body is None else pickle.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class ChannelServer:
    """The leader's listening socket; `accept_all` takes every follower's connections."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.create_server((host, 0))
        self.address = ChannelAddress(host, self._sock.getsockname()[1], secrets.token_hex(16))

    def accept_all(self, followers: list[int], timeout_s: float) -> dict[tuple[int, str], socket.socket]:
        """(rank, purpose in PURPOSES) → connected socket, for every follower rank; raises TimeoutError when they
        have not all dialled within `timeout_s`. A dialler without the token is dropped."""
        wanted = {(r, purpose) for r in followers for purpose in PURPOSES}
        got: dict[tuple[int, str], socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - got.keys())
                raise TimeoutError(f"the group's followers did not all connect within {timeout_s} s: {missing}")
            self._sock.settimeout(left)
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(left)
            hello = recv_frame(conn)
            conn.settimeout(None)
            if not (isinstance(hello, tuple) and len(hello) == 3 and isinstance(hello[0], str)):
                conn.close()
                continue
            token, rank, purpose = hello
            if not hmac.compare_digest(token, self.address.token) or (rank, purpose) not in wanted:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got[(rank, purpose)] = conn
        return got

    def close(self) -> None:
        self._sock.close()


def dial(address: ChannelAddress, rank: int, purpose: str, timeout_s: float) -> socket.socket:
    """A follower's connection to its leader's channel server."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, (address.token, rank, purpose))
    return sock
