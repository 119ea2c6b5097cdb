"""Which sends the server may post from its event loop, before it answers the Pull.

A send posted on the loop (`Pair.post_send`) is on the wire as soon as the puller posts its recvs; one handed
to a send thread first waits for that thread to be scheduled, which on loaded cores costs milliseconds per
pull (measured: docs/journal/benchmarks.md, "Where a pull's milliseconds go"). Only sends whose pieces cost next to
nothing to produce are posted there, since the loop also drives the engine's steps:

- a `PoolKv` sent the direct way (views of the pool, no copy), the flat way (one gather under
  `SMALL_KV_BYTES`, ~0.1 ms) or the gathered way (the same gather, into receives posted before the Pull:
  posted.py);
- an export copy already in host memory, over gloo.

Everything else keeps the send thread: the layered way (its gather of every layer overlaps the wire there),
a layer-streamed send (its pieces wait for the forward pass to write each layer: layer_stream.py), a CUDA
export (the send stream's ordering, send_stream.py), NCCL, and the test-only faults.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.pair import TransferBackend
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.source import Outgoing
from shared.kv.transfer.wire import pieces


def loop_pieces(kv: Outgoing, backend: TransferBackend, chunk_bytes: int) -> Iterable[torch.Tensor] | None:
    """The pieces of `kv` in wire order, if they may be posted from the event loop; None: use a send thread."""
    if backend is not TransferBackend.GLOO or isinstance(kv, StreamedPoolKv):
        return None
    if isinstance(kv, PoolKv):
        return None if kv.mode == "layered" else kv.pieces(chunk_bytes)
    if kv.blocks.device.type != "cpu":
        return None
    return pieces(kv.blocks.contiguous(), chunk_bytes)
