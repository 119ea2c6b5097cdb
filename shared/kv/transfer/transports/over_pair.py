"""What the transports over the pair's collective group share (plain_pair.py, posted_pair.py, streamed.py): the
server's send of pieces under consecutive tags, posted from the loop where cheap (loop_send.py) or on a send
thread, and the client's receive of the announced pieces into a buffer.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.loop_send import loop_pieces
from shared.kv.transfer.pair import Pair, TransferBackend
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.segment_send import InjectedFault
from shared.kv.transfer.source import Outgoing
from shared.kv.transfer.transports.base import Arrival
from shared.kv.transfer.transports.receives import Receives
from shared.kv.transfer.transports.sends import SendJob, Sends
from shared.kv.transfer.wire import pieces, received
from shared.rpc import kv_transfer_pb2 as pb

# ---- prefill side -----------------------------------------------------------------------------------------


def start_send(sends: Sends, job: SendJob, kv: Outgoing, tag: int) -> None:
    """Send `kv` over the job's pair from `tag` on: posted now where that is cheap, before the reply leaves; the
    rest (its wait, or the whole send on a send thread) runs after it, and ends the job."""
    sends.start(_finish(sends, job, kv, _post_now(sends, job.pair, kv, tag)))


def _post_now(sends: Sends, pair: Pair, kv: Outgoing, tag: int) -> Callable[[], None]:
    """Post the send from the loop where that is cheap (loop_send.py); returns the blocking rest of the send (its
    wait, or the whole send on a thread), which raises if it failed."""
    settings = sends.settings
    parts = None if settings.faults else loop_pieces(kv, settings.backend, settings.chunk_bytes)
    if parts is None:
        return functools.partial(_send_blocking, sends, pair, kv, tag)
    try:
        return pair.post_send(parts, tag).wait
    except Exception as e:  # the pair closed under us: the send task fails it as any failed send
        return functools.partial(_reraise, e)


async def _finish(sends: Sends, job: SendJob, kv: Outgoing, finish: Callable[[], None]) -> None:
    """Finish the send (`finish` blocks: on a send thread), then end it whatever happened.

    A failed send drops the pair: gloo has closed it already after an error or timeout, and closing it here too
    destroys the group once idle, so the receiver's pending recvs fail at once."""
    error = None
    try:
        await sends.run_in_thread(finish)
        sends.sent(job, kv.nbytes)
    except Exception as e:  # timeout, peer gone, pair closed under us, or the injected fault
        error = sends.failed(job, e)
    finally:
        await sends.end(job, error)


def _send_blocking(sends: Sends, pair: Pair, kv: Outgoing, tag: int) -> None:
    """On a send thread, on the send stream: returns once the send's work is done (its buffer is free). An
    injected fault sends the first piece (none when the KV is one piece, so the fault always bites) and fails."""
    settings = sends.settings
    if isinstance(kv, PoolKv):  # host memory, straight from the blocks: no stream to order against
        _send_pieces(settings.fault_send_midway, settings.fault_send_stall_s, pair, kv.pieces(settings.chunk_bytes),
                     kv.num_pieces(settings.chunk_bytes), tag)  # fmt: skip
        return
    with settings.send_stream.sending([kv.blocks]):
        # gloo sends host memory (a CUDA pool's export is copied down); NCCL sends from the GPU as is.
        blocks = (kv.blocks if settings.backend is TransferBackend.NCCL else kv.blocks.cpu()).contiguous()
        parts = pieces(blocks, settings.chunk_bytes)
        _send_pieces(settings.fault_send_midway, settings.fault_send_stall_s, pair, iter(parts), len(parts), tag)


def _send_pieces(midway: bool, stall_s: float, pair: Pair, parts, count: int, tag: int) -> None:
    if not (midway or stall_s):
        pair.send(parts, tag)
        return
    first = list(itertools.islice(parts, 1 if count > 1 else 0))
    pair.send(first, tag)
    time.sleep(stall_s)
    if midway:
        raise InjectedFault(f"injected fault: sent {len(first)} of {count} pieces, then dropped the pair")
    pair.send(parts, tag + len(first))


def _reraise(error: Exception) -> NoReturn:
    raise error


# ---- decode side ------------------------------------------------------------------------------------------


def receive(
    receives: Receives,
    pair: Pair,
    reply: pb.PullReply,
    source: KVLayout,
    buffer: torch.Tensor,
    parts: Sequence[torch.Tensor],
    done: Callable[[KVExport], KVExport],
) -> Arrival:
    """Receive the announced pieces `parts` (of `buffer`, from the reply's tag on): gloo's are posted now, from
    the loop, and waited for in a thread (pair.py); `done` turns the filled buffer into the result."""
    if receives.backend is TransferBackend.GLOO:
        wait = pair.post_recv(parts, reply.tag).wait
    else:
        wait = functools.partial(pair.recv, parts, reply.tag)
    return Arrival(lambda: done(arrived(receives, reply, source, buffer)), wait)


def arrived(receives: Receives, reply: pb.PullReply, source: KVLayout, buffer: torch.Tensor) -> KVExport:
    """Count a pull whose bytes are in `buffer`; the KVExport the reply announced."""
    receives.stats.pulls += 1
    receives.stats.bytes_received += buffer.numel() * buffer.element_size()
    return received(reply, source, buffer)
