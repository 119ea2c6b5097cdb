"""The client's side of every transport: `Receives`, what a transport's client half is handed (settings, the
receive buffers, the stats), and `Link`, the formed pair a receiver uses.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shared.kv.transfer.buffers import BufferPool
from shared.kv.transfer.local_stream import LocalCall
from shared.kv.transfer.pair import Pair, TransferBackend
from shared.kv.transfer.pull_stream import PullStream


@dataclass
class ClientStats:
    connects: int = 0  # pairs joined: one process group constructed each
    pulls: int = 0  # pulls completed
    shm_pulls: int = 0  # of which arrived through a shared segment
    streamed_pulls: int = 0  # of which were sent layer by layer, the first token after them (layer_stream.py)
    posted_pulls: int = 0  # of which arrived in receives posted before the Pull (posted.py)
    abandoned_posts: int = 0  # pulls whose posted receives went unused (refused, failed, ignored): pair dropped
    local_pulls: int = 0  # Pulls answered over a same-host pair's Unix socket, not gRPC (local_stream.py)
    borrowed_pulls: int = 0  # of which lent in place: the blocks are copied from the prefill pool (borrow.py)
    bytes_received: int = 0
    by_transport: Counter[str] = field(default_factory=Counter)  # completed pulls by the transport that took them


@dataclass
class Receives:
    """What a transport's client half is handed (KvTransferClient's docstring has each setting)."""

    backend: TransferBackend
    model_name: str
    stats: ClientStats
    buffers: BufferPool  # receive buffers, reused across pulls (`recycle` hands them back)
    executor: ThreadPoolExecutor  # blocking waits
    borrow: bool = True  # map a same-host prefill pool and borrow blocks in place


@dataclass
class Link:
    """A formed pair as its receivers use it: the collective group, and the carrier its Pulls go over."""

    pair: Pair
    pulls: PullStream  # the pair's Pulls (and borrowed KV's releases)
    local: LocalCall | None  # the carrier is the server's Unix socket (same host); None: gRPC
