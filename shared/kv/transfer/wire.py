"""What a Pull reply announces about the tensor that follows on the pair, and the receiver's checks of it.

Tensors travel as raw bytes on the collective channel; the reply carries their shape, dtype and source
block size so the receiver can allocate the buffer up front and re-cut blocks to its own size later, and
the sender's chunk size: both sides cut the contiguous tensor into the same pieces (`pieces`), piece i
travelling under tag + i. Cutting is what lets a transfer fail midway (one piece out, the rest not).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.rpc import kv_transfer_pb2 as pb

MAX_PIECES = 1 << 20  # an announcement that cuts a tensor finer than this is refused (tags, posted recvs)


def describe(kv: KVExport, tag: int, chunk_bytes: int) -> pb.PullReply:
    return pb.PullReply(
        num_tokens=kv.num_tokens,
        first_block=kv.first_block,
        shape=list(kv.blocks.shape),
        dtype=kv.layout.dtype,
        block_size=kv.layout.block_size,
        tag=tag,
        chunk_bytes=chunk_bytes,
    )


def num_pieces(numel: int, element_size: int, chunk_bytes: int) -> int:
    """How many pieces `pieces` cuts a tensor of numel elements into."""
    if chunk_bytes <= 0:
        return 1
    return max(1, math.ceil(numel / _piece_numel(element_size, chunk_bytes)))


def pieces(tensor: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """A contiguous tensor as consecutive flat views of at most chunk_bytes each (whole elements, at least
    one); the tensor itself when it fits in one piece or chunk_bytes is 0. No copy."""
    if num_pieces(tensor.numel(), tensor.element_size(), chunk_bytes) == 1:
        return [tensor]
    return list(tensor.view(-1).split(_piece_numel(tensor.element_size(), chunk_bytes)))


def _piece_numel(element_size: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // element_size)


def announced_layout(reply: pb.PullReply, layout: KVLayout) -> KVLayout:
    """The layout of the tensor announced, (L, 2, n, B_src, KVH, hd) with the source's block size. Raises
    KvTransferError(PROTOCOL) when the announcement does not fit `layout` (the receiver's) or itself."""
    shape = tuple(reply.shape)
    expected = (layout.num_layers, 2, None, reply.block_size, layout.num_held_kv_heads, layout.head_dim)
    fits = len(shape) == 6 and all(want is None or got == want for got, want in zip(shape, expected, strict=True))
    if not fits or reply.dtype != layout.dtype or reply.block_size < 1:
        raise KvTransferError(
            FailureReason.PROTOCOL, f"announced {reply.dtype} {shape} does not match the receiver's layout {layout}"
        )
    if reply.num_tokens < 1 or shape[2] != math.ceil(reply.num_tokens / reply.block_size) - reply.first_block:
        raise KvTransferError(
            FailureReason.PROTOCOL,
            f"{reply.num_tokens} tokens from block {reply.first_block} on do not fill {shape[2]} blocks of "
            f"{reply.block_size}",
        )
    if num_pieces(math.prod(shape), layout.torch_dtype.itemsize, reply.chunk_bytes) > MAX_PIECES:
        raise KvTransferError(FailureReason.PROTOCOL, f"chunks of {reply.chunk_bytes} bytes cut {shape} too fine")
    return dataclasses.replace(layout, block_size=reply.block_size)
