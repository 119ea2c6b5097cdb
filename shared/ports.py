"""Free ports for the servers a process is about to start (a stack's services, a worker group's rendezvous).

A port is picked at random below the kernel's ephemeral range, checked free by binding it, and never handed out
twice by one process. Why not bind port 0 and take what the kernel gives: that port comes from the ephemeral range
and is free again once the probe closes, and until the server that gets it binds it, any process on the host may
take it as the local port of an outgoing connection (those draw from the same range), or get it from its own
bind to port 0. Two test processes starting stacks at once met that race ("Address already in use"). A port below
the range is never an outgoing connection's; two processes picking at random from ~16k ports seldom meet.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, and what a host without /proc gets
_LOWEST = 10000  # below: well-known and registered ports more often in use by something else
_TRIES = 200

_random = random.SystemRandom()  # a forked child must not draw the ports its parent draws
_lock = threading.Lock()
_handed_out: set[tuple[str, int]] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections and binds to port 0: (first, last)."""
    try:
        first, last = (int(n) for n in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return first, last


def candidate_ports() -> range:
    """Where free_port looks: below the ephemeral range, above the commonly used ports (empty on a host whose
    ephemeral range starts below 10000)."""
    first, _ = ephemeral_range()
    return range(_LOWEST, first)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now and this process has not handed out before; from the ephemeral
    range only when no other is found (then with the race above)."""
    candidates = candidate_ports()
    with _lock:
        for _ in range(_TRIES if candidates else 0):
            port = _random.choice(candidates)
            if (host, port) not in _handed_out and _bindable(host, port):
                _handed_out.add((host, port))
                return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add((host, port))
        return port
