"""What a Pull reply announces about the tensor that follows on the pair, and the receiver's checks of it.

Tensors travel as raw bytes on the collective channel; the reply carries their shape, dtype and source
block size so the receiver can allocate the buffer up front and re-cut blocks to its own size later, and
the sender's chunk size: both sides cut the tensor into the same pieces, piece i travelling under tag + i.
Cutting is what lets a transfer fail midway (one piece out, the rest not).

Two cuts, told apart by the reply's `runs`:
- none (an export copy, contiguous): the flat tensor in pieces of at most chunk_bytes (`pieces`);
- block runs (a send straight from the pool, pool_kv.py): the blocks are `runs` consecutive runs (counts,
  summing to the block count); for each layer, each plane, each run, the receiver's slice
  tensor[layer, plane, start:start + count] (contiguous) is one segment, itself cut by chunk_bytes
  (`segment_pieces`). On the sender each segment is a view of the pool, or of a layer gathered just before.

A model of several KV cache groups (shared/engine/kv_groups.py: gpt-oss's full and sliding layers) sends
its export (KVExport.parts) flat: the reply's `groups` say, per group, its layers, first block and block count,
and `shape` is the flat tensor's one dimension (`received` rebuilds the export on the receiver).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shared.engine.kv_export import KVExport, KVPart
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.rpc import kv_transfer_pb2 as pb

MAX_TAG = (1 << 31) - 1  # gloo tags are ints; a transfer's pieces take consecutive ones below this
MAX_PIECES = 1 << 20  # an announcement that cuts a tensor finer than this is refused (tags, posted recvs)


def describe(kv: KVExport, tag: int, chunk_bytes: int) -> pb.PullReply:
    """The reply announcing an export copy (the flat cut)."""
    shape = tuple(kv.blocks.shape)
    return announce(kv.layout, kv.num_tokens, shape, tag, chunk_bytes, first_block=kv.first_block, groups=kv.parts)


def announce(
    layout: KVLayout,
    num_tokens: int,
    shape: tuple[int, ...],
    tag: int,
    chunk_bytes: int,
    runs: list[int] | None = None,
    first_block: int = 0,
    groups: tuple[KVPart, ...] = (),
) -> pb.PullReply:
    """The reply announcing a tensor of `shape`; `runs`: the block-run cut (None or []: the flat cut);
    `first_block`: the request's block the tensor starts at (those before are behind the sliding window);
    `groups`: a grouped export's parts (KVExport.parts; `shape` is then flat)."""
    return pb.PullReply(
        num_tokens=num_tokens,
        first_block=first_block,
        shape=list(shape),
        dtype=layout.dtype,
        block_size=layout.block_size,
        tag=tag,
        chunk_bytes=chunk_bytes,
        runs=runs or [],
        groups=[_span(g) for g in groups],
    )


def _span(part: KVPart) -> pb.KvGroupSpan:
    return pb.KvGroupSpan(num_layers=part.num_layers, first_block=part.first_block, num_blocks=part.num_blocks)


def received(reply: pb.PullReply, source: KVLayout, blocks: torch.Tensor) -> KVExport:
    """The export a receiver holds once `blocks` (shaped as announced) arrived; `source`: announced_layout's."""
    parts = tuple(KVPart(g.num_layers, g.first_block, g.num_blocks) for g in reply.groups)
    return KVExport(source, reply.num_tokens, blocks, first_block=reply.first_block, parts=parts)


def segments(num_layers: int, num_planes: int, runs: list[int]) -> list[tuple[int, int, int, int]]:
    """The segments of a block-run cut, in wire order: (layer, plane, run index, first block in the tensor)."""
    starts = [sum(runs[:i]) for i in range(len(runs))]
    order = ((layer, plane, i) for layer in range(num_layers) for plane in range(num_planes) for i in range(len(runs)))
    return [(layer, plane, i, starts[i]) for layer, plane, i in order]


def num_segment_pieces(shape: tuple[int, ...], runs: list[int], element_size: int, chunk_bytes: int) -> int:
    """How many pieces `segment_pieces` cuts a tensor of `shape` into."""
    per_block = math.prod(shape[3:])  # elements of one block of one layer's plane
    per_layer_plane = sum(num_pieces(count * per_block, element_size, chunk_bytes) for count in runs)
    return shape[0] * shape[1] * per_layer_plane


def segment_pieces(tensor: torch.Tensor, runs: list[int], chunk_bytes: int) -> list[torch.Tensor]:
    """The receiver's pieces of a block-run cut: views of `tensor` (L, planes, n, ...) in wire order."""
    out: list[torch.Tensor] = []
    for layer, plane, i, start in segments(tensor.shape[0], tensor.shape[1], runs):
        out += pieces(tensor[layer, plane, start : start + runs[i]], chunk_bytes)
    return out


def receive_pieces(tensor: torch.Tensor, reply: pb.PullReply) -> list[torch.Tensor]:
    """The pieces the receiver fills, cut as the reply announced."""
    if reply.runs:
        return segment_pieces(tensor, list(reply.runs), reply.chunk_bytes)
    return pieces(tensor, reply.chunk_bytes)


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
    """The layout of the tensor announced, (L, P, n, B_src, KVH, hd) with the source's block size. Raises
    KvTransferError(PROTOCOL) when the announcement does not fit `layout` (the receiver's) or itself."""
    if reply.groups:
        return _announced_groups(reply, layout)
    shape = tuple(reply.shape)
    expected = (layout.num_layers, layout.planes, None, reply.block_size, layout.num_held_kv_heads, layout.head_dim)
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
    if reply.runs and (min(reply.runs) < 1 or sum(reply.runs) != shape[2] or len(reply.runs) > shape[2]):
        raise KvTransferError(FailureReason.PROTOCOL, f"block runs {list(reply.runs)[:8]} do not cut {shape[2]} blocks")
    itemsize = layout.torch_dtype.itemsize
    if reply.runs:
        count = num_segment_pieces(shape, list(reply.runs), itemsize, reply.chunk_bytes)
    else:
        count = num_pieces(math.prod(shape), itemsize, reply.chunk_bytes)
    if count > MAX_PIECES:
        raise KvTransferError(FailureReason.PROTOCOL, f"chunks of {reply.chunk_bytes} bytes cut {shape} too fine")
    return dataclasses.replace(layout, block_size=reply.block_size)


def _announced_groups(reply: pb.PullReply, layout: KVLayout) -> KVLayout:
    """announced_layout of a grouped reply: the groups' layers add up to the model's, each group's blocks run from
    its first block to the last token's, the flat shape holds exactly them."""
    source = dataclasses.replace(layout, block_size=max(reply.block_size, 1))
    per_block = layout.planes * reply.block_size * layout.num_held_kv_heads * layout.head_dim
    numel = sum(g.num_layers * g.num_blocks * per_block for g in reply.groups)
    need = math.ceil(reply.num_tokens / max(reply.block_size, 1))
    fits = (
        reply.dtype == layout.dtype
        and reply.block_size >= 1
        and reply.num_tokens >= 1
        and not reply.runs
        and reply.first_block == 0
        and sum(g.num_layers for g in reply.groups) == layout.num_layers
        and all(g.num_layers >= 1 and g.num_blocks == need - g.first_block for g in reply.groups)
        and tuple(reply.shape) == (numel,)
    )
    if not fits:
        spans = [(g.num_layers, g.first_block, g.num_blocks) for g in reply.groups]
        raise KvTransferError(
            FailureReason.PROTOCOL,
            f"announced {reply.dtype} {list(reply.shape)} in groups {spans} (layers, first block, blocks) for "
            f"{reply.num_tokens} tokens does not match the receiver's layout {layout}",
        )
    if num_pieces(numel, layout.torch_dtype.itemsize, reply.chunk_bytes) > MAX_PIECES:
        raise KvTransferError(FailureReason.PROTOCOL, f"chunks of {reply.chunk_bytes} bytes cut {numel} too fine")
    return source
