"""Pre-posted pulls: the decode side posts its receives before its Pull RPC; the server sends into them.

Why: gloo's TCP transport moves a send only once the receiver's "recv ready" notice has reached the sender.
A receive posted after the reply costs, on top of the Pull round trip, the reply's trip to the decode loop
and that notice's trip back before the first byte moves. A decode worker already knows what it will receive
(the KV location's token count, its own layout, the source's block size and chunk size from Connect), so it
posts the receives first; the server, once the ticket and the layout check out, posts its sends at once and
the bytes move while the reply is still on its way.

The cut both sides agree on without a reply, chosen by the decode side (`PostedRecv.cut`):
- **one run** (wire.segment_pieces with runs = [n]): each (layer, plane) slice of the (L, P, n, B_src, KVH,
  hd) tensor is one segment, cut by the server's chunk_bytes. A pool-direct send of one run is exactly that
  (views of the pool, posted from the loop); scattered blocks are gathered layer by layer on the send
  thread (the layered way announces one run anyway), a small KV gathered whole and sent as those slices;
- **flat** (wire.pieces of the whole tensor), for a KV under pool_kv.SMALL_KV_BYTES: one gathered message,
  as the flat way sends it (a message costs more than such a copy).

Failure paths (docs/kv_transfer.md, "Pre-posted pulls"): the reply says whether the server used the posted
receives (`PullReply.posted`). Whenever they are not used — the Pull was refused (ticket, pair, request,
fingerprint, already pulling), failed, or the server ignored them (another token count, a streamed, windowed,
grouped or shared-memory send) — the client abandons them at once (`Posted.forsake`: no wait, no thread,
the buffer dropped) and forgets the pair, so the gloo registrations of those receives go with it; the next
pull forms a new pair. The server never sends on the decode side's tag range unless it accepted the posted
layout, so an abandoned receive is never written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.layer_stream import StreamedPoolKv
from shared.kv.transfer.pair import Pair, Posted
from shared.kv.transfer.pool_kv import SMALL_KV_BYTES, PoolKv
from shared.kv.transfer.source import Outgoing
from shared.kv.transfer.wire import MAX_TAG, num_pieces, num_segment_pieces, pieces, segment_pieces
from shared.rpc import kv_transfer_pb2 as pb

# Tags [POSTED_TAG_BASE, MAX_TAG) are the decode side's, for its posted receives; the server hands out tags
# below it (slots.py). Transfers in flight on a pair thus never share a tag, whoever chose it.
POSTED_TAG_BASE = 1 << 30


def can_post(layout: KVLayout) -> bool:
    """Whether a receiver of `layout` may post before the reply: whole KV of one group, no sliding windows
    (a windowed model's first block, and a grouped model's spans, are known only from the reply)."""
    return not layout.kv_heads and all(window is None for window in layout.layer_windows)


def posted_shape(layout: KVLayout, block_size: int, num_tokens: int) -> tuple[int, ...]:
    """(L, P, n, B_src, KVH, hd): the tensor of `num_tokens` tokens' KV at the source's block size."""
    blocks = math.ceil(num_tokens / block_size)
    return (layout.num_layers, layout.planes, blocks, block_size, layout.num_held_kv_heads, layout.head_dim)


# ---- prefill side -----------------------------------------------------------------------------------------


def posted_kv(kv: Outgoing, posted: pb.PostedRecv, chunk_bytes: int) -> PoolKv | None:
    """The send that fills the receives `posted` describes, if `kv` is exactly that; None: ignore them.

    The pieces must match the receiver's one by one (gloo aborts a receiver whose recv differs in size), so
    anything but a one-group, unwindowed, unstreamed pool send of the announced token and block counts is
    refused here, before any byte moves."""
    if not isinstance(kv, PoolKv) or isinstance(kv, StreamedPoolKv) or kv.first_block or kv.parts:
        return None
    blocks = len(kv.block_ids)
    if kv.num_tokens != posted.num_tokens or blocks != posted.num_blocks or blocks < 1:
        return None
    count = posted_pieces(kv.shape, posted.cut, kv.pool.tensor.element_size(), chunk_bytes)
    if posted.tag < POSTED_TAG_BASE or posted.tag + count > MAX_TAG:
        return None
    if posted.cut == pb.POSTED_CUT_FLAT:  # one gather (small), one message
        staging = kv.staging if kv.staging is not None else torch.empty(kv.shape, dtype=kv.pool.tensor.dtype)
        return kv if kv.mode == "flat" else dataclasses.replace(kv, mode="flat", staging=staging)
    if kv.mode == "direct" and len(kv.runs) == 1:
        return kv
    if kv.mode == "flat":  # small: one gather, then its (layer, plane) slices, from the loop
        return dataclasses.replace(kv, mode="gathered")
    staging = kv.staging if kv.staging is not None else torch.empty(kv.shape, dtype=kv.pool.tensor.dtype)
    return dataclasses.replace(kv, mode="layered", staging=staging)  # scattered runs: gathered per layer


def posted_cut(shape: tuple[int, ...], element_size: int) -> pb.PostedCut:
    """The cut a receiver posts for a tensor of `shape`: flat under SMALL_KV_BYTES, else one run."""
    small = math.prod(shape) * element_size < SMALL_KV_BYTES
    return pb.POSTED_CUT_FLAT if small else pb.POSTED_CUT_ONE_RUN


def posted_pieces(shape: tuple[int, ...], cut: pb.PostedCut, element_size: int, chunk_bytes: int) -> int:
    """How many pieces (consecutive tags) receives of `cut` take."""
    if cut == pb.POSTED_CUT_FLAT:
        return num_pieces(math.prod(shape), element_size, chunk_bytes)
    return num_segment_pieces(shape, [shape[2]], element_size, chunk_bytes)


# ---- decode side ------------------------------------------------------------------------------------------


@dataclass
class PostedPull:
    """The receives of one pull, posted on a pair before its Pull: waited for once the reply says the server
    sends into them, else abandoned (`abandon`). Owns the buffer until then."""

    message: pb.PostedRecv
    shape: tuple[int, ...]
    buffer: torch.Tensor
    transfer: Posted
    chunk_bytes: int

    @classmethod
    def post(
        cls, pair: Pair, buffer: torch.Tensor, tag: int, num_tokens: int, cut: pb.PostedCut, chunk_bytes: int
    ) -> PostedPull:
        """Post the receives of `buffer` (posted_shape's), cut by `cut`, under tag, tag + 1, …; returns at once."""
        shape = tuple(buffer.shape)
        flat = cut == pb.POSTED_CUT_FLAT
        parts = pieces(buffer, chunk_bytes) if flat else segment_pieces(buffer, [shape[2]], chunk_bytes)
        transfer = pair.post_recv(parts, tag)
        message = pb.PostedRecv(tag=tag, num_tokens=num_tokens, num_blocks=shape[2], cut=cut)
        return cls(message, shape, buffer, transfer, chunk_bytes)

    def check(self, reply: pb.PullReply) -> None:
        """The reply of a pull the server sent into these receives must announce exactly them; PROTOCOL else."""
        fits = (
            tuple(reply.shape) == self.shape
            and list(reply.runs) == ([] if self.message.cut == pb.POSTED_CUT_FLAT else [self.shape[2]])
            and reply.tag == self.message.tag
            and reply.chunk_bytes == self.chunk_bytes
            and reply.num_tokens == self.message.num_tokens
            and not (reply.first_block or reply.groups or reply.layer_streamed or reply.shm_bytes)
        )
        if not fits:
            raise KvTransferError(
                FailureReason.PROTOCOL,
                f"the reply announces {list(reply.shape)} runs {list(reply.runs)[:4]} tag {reply.tag}, not the "
                f"posted {list(self.shape)} at tag {self.message.tag}",
            )

    def abandon(self) -> None:
        """Give up the receives without waiting (nothing will be sent into them); the caller must forget the
        pair, whose gloo state still names them."""
        self.transfer.forsake()
