"""The server's side of every transport: what a send is (`SendJob`), and `Sends`, what a transport's server half
is handed: the server's settings, its send threads, and the one way a send ends (`end`: the source frees or keeps
the blocks, the span closes), with its metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from shared.engine.kv_pool import KVLayout
from shared.engine.shared_pool import PoolHandle
from shared.kv.transfer.borrow import Lender
from shared.kv.transfer.pair import Pair, TransferBackend
from shared.kv.transfer.segment_send import InjectedFault
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.slots import Slot
from shared.kv.transfer.source import KvSource, Outgoing
from shared.rpc import kv_transfer_pb2 as pb
from shared.telemetry import metrics, tracing

log = logging.getLogger(__name__)


@dataclass
class ServerStats:
    pairs_created: int = 0  # Connect calls accepted: one process group each
    pulls: int = 0  # pulls accepted (export done, send started)
    shm_pulls: int = 0  # of which written into a pair's shared segment
    borrowed_pulls: int = 0  # of which lent in place: the puller copied the blocks from the shared pool
    streamed_pulls: int = 0  # of which sent layer by layer as the prefill wrote them (layer_stream.py)
    posted_pulls: int = 0  # of which sent into receives the puller posted before its Pull (posted.py)
    segments: int = 0  # shared segments created (one per same-host pair)
    bytes_sent: int = 0
    failed_sends: int = 0  # injected faults included
    refused: int = 0  # calls refused for their ticket or as malformed
    by_transport: Counter[str] = field(default_factory=Counter)  # accepted pulls by the transport that took them


@dataclass
class SendSettings:
    """The server's settings every transport reads (KvTransferServer's docstring has each; a test may change
    chunk_bytes between pulls, through the server)."""

    backend: TransferBackend
    timeout_s: float
    chunk_bytes: int
    model_name: str
    send_stream: SendStream
    fault_send_midway: bool = False
    fault_send_stall_s: float = 0.0
    host_id: str = ""  # this machine's identity (shm.host_identity); "": no same-host transport
    shm_bytes: int = 0
    shared_pool: PoolHandle | None = None

    @property
    def faults(self) -> bool:
        """A test fault is on: sends act on copies, piece by piece, on a send thread."""
        return self.fault_send_midway or bool(self.fault_send_stall_s)


@dataclass
class SendJob:
    """One accepted pull: checked, its KV exported (the source counts it as sending until `Sends.end`)."""

    request: pb.PullRequest
    kv: Outgoing
    slot: Slot
    pair: Pair
    span: Any  # the `send_kv` span, ended by `Sends.end`
    started: float  # perf_counter at accept
    context: grpc.aio.ServicerContext  # the call (or the stream's message) to abort
    lender: Lender | None = None  # the loans of the same-host Unix socket the Pull came over; None: gRPC

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Sends:
    """What a transport's server half is handed: settings, the source's layout, send threads, and how sends end."""

    def __init__(
        self,
        settings: SendSettings,
        source: KvSource,
        stats: ServerStats,
        executor: ThreadPoolExecutor,
        drop: Callable[[Slot], None],
    ) -> None:
        self.settings = settings
        self.source = source
        self.stats = stats
        self.executor = executor
        self.drop = drop  # forget a pair (a later Pull naming it gets ABORTED) and close it
        self.labels = (settings.model_name, "prefill")
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def layout(self) -> KVLayout:
        return self.source.layout

    def run_in_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def start(self, send: Coroutine[Any, Any, None]) -> None:
        """Run the rest of a send after the reply; `stop` waits for it."""
        task = asyncio.create_task(send)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_all(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def sent(self, job: SendJob, nbytes: int) -> None:
        """Count a send whose bytes are out (or were copied by the puller)."""
        self.stats.bytes_sent += nbytes
        metrics.KV_TRANSFER_BYTES.labels(*self.labels).inc(nbytes)
        metrics.KV_TRANSFER_SECONDS.labels(*self.labels).observe(time.perf_counter() - job.started)

    def failed(self, job: SendJob, error: Exception, what: str = "send") -> str:
        """Count, log and drop the pair of a send that failed; returns the error its span ends with."""
        self.stats.failed_sends += 1
        reason = "fault_injected" if isinstance(error, InjectedFault) else "send_failed"
        metrics.KV_TRANSFER_FAILURES.labels(*self.labels, reason).inc()
        log.warning("KV %s of %s to %s failed: %s", what, job.request_id, job.slot.worker_id, error)
        self.drop(job.slot)
        return f"{what} failed: {error!r}"

    async def end(self, job: SendJob, error: str | None) -> None:
        """A send is over, whatever its transport: the source frees the blocks, the span ends. Once per job."""
        try:
            await self.source.end_send(job.request_id, ok=error is None)
        except Exception:
            log.exception("ending the send of %s failed", job.request_id)
        job.span.set_attribute(tracing.KV_DURATION, time.perf_counter() - job.started)
        tracing.end_span(job.span, error=error)
