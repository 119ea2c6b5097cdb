"""Partial pulls, the source's half: a decode worker that holds a prompt's first tokens in its own prefix cache
asks for the KV from there on (PullRequest.skip_tokens), and only the blocks it lacks go on the wire.

`skip_cached(kv, skip_tokens)` cuts what a send would move down to the blocks from the one holding token
`skip_tokens` on, in the source's blocks: the tensor's first block becomes max(its first_block, skip_tokens // B),
never past the request's last block (a pull always carries the last token's block). The cut is taken where it is
cheap and exact, and else the KV goes whole (the decode side sees an earlier first_block and imports all of it):

- an export copy (KVExport, one KV cache group): its later blocks, copied into one tensor;
- the pool's blocks (PoolKv, planned for a send): the later block ids, the staging buffer's front reused;
- left whole: a grouped export of several KV cache groups (its parts carry their own first blocks, a window
  group's only its window's) and a layer-streamed send (its blocks are announced before the prefill wrote them).
"""

from __future__ import annotations

import dataclasses
import math

from shared.engine.kv_export import KVExport
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.source import Outgoing


def skip_cached(kv: Outgoing, skip_tokens: int) -> Outgoing:
    """`kv` from the block holding token `skip_tokens` on (module doc); `kv` itself when nothing is cut."""
    if skip_tokens <= 0 or kv.parts or type(kv) not in (KVExport, PoolKv):
        return kv
    block_size = kv.layout.block_size
    last = math.ceil(kv.num_tokens / block_size) - 1  # the request's last block: always sent
    first = min(skip_tokens // block_size, last)
    cut = first - kv.first_block  # leading blocks of the tensor (or of block_ids) the decode side holds
    if cut <= 0:
        return kv
    if isinstance(kv, PoolKv):
        block_ids = kv.block_ids[cut:]
        staging = None if kv.staging is None else _front(kv.staging, len(block_ids))
        return dataclasses.replace(kv, block_ids=block_ids, staging=staging, first_block=first)
    blocks = kv.blocks[:, :, cut:].contiguous()  # (L, P, n - cut, B, KVH, hd)
    return KVExport(kv.layout, kv.num_tokens, blocks, first_block=first)


def _front(staging, num_blocks: int):
    """A contiguous (L, P, num_blocks, B, KVH, hd) view at the front of a staging buffer cut for more blocks."""
    L, planes, _, *rest = staging.shape
    shape = (L, planes, num_blocks, *rest)
    return staging.view(-1)[: math.prod(shape)].view(shape)
