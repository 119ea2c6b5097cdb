"""What a Pull reply announces about the tensor that follows on the pair, and the receiver's checks of it.

Tensors travel as raw bytes on the collective channel; the reply carries their shape, dtype and source
block size so the receiver can allocate the buffer up front and re-cut blocks to its own size later.
"""

from __future__ import annotations

import dataclasses
import math

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.rpc import kv_transfer_pb2 as pb


def describe(kv: KVExport, tag: int) -> pb.PullReply:
    return pb.PullReply(
        num_tokens=kv.num_tokens,
        shape=list(kv.blocks.shape),
        dtype=kv.layout.dtype,
        block_size=kv.layout.block_size,
        tag=tag,
    )


def announced_layout(reply: pb.PullReply, layout: KVLayout) -> KVLayout:
    """The layout of the tensor announced, (L, 2, n, B_src, KVH, hd) with the source's block size. Raises
    KvTransferError(PROTOCOL) when the announcement does not fit `layout` (the receiver's) or itself."""
    shape = tuple(reply.shape)
    expected = (layout.num_layers, 2, None, reply.block_size, layout.num_kv_heads, layout.head_dim)
    fits = len(shape) == 6 and all(want is None or got == want for got, want in zip(shape, expected, strict=True))
    if not fits or reply.dtype != layout.dtype or reply.block_size < 1:
        raise KvTransferError(
            FailureReason.PROTOCOL, f"announced {reply.dtype} {shape} does not match the receiver's layout {layout}"
        )
    if reply.num_tokens < 1 or shape[2] != math.ceil(reply.num_tokens / reply.block_size):
        raise KvTransferError(
            FailureReason.PROTOCOL, f"{reply.num_tokens} tokens do not fill {shape[2]} blocks of {reply.block_size}"
        )
    return dataclasses.replace(layout, block_size=reply.block_size)
