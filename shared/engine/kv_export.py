"""One request's KV cache as a self-describing value: what a prefill engine hands to a decode engine.

A model with one KV cache group (shared/engine/kv_groups.py) exports one tensor (L, P, n, B, KVH, hd). A model
whose full and sliding layers form several groups exports, per group, the blocks that group holds (a window
group only its window's) from that group's first held block on: `parts` describes them, and `blocks` is their
tensors concatenated flat, in group order (one buffer: the wire sends it as one flat tensor, wire.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shared.engine.kv_pool import KVLayout, KVPool


@dataclass(frozen=True)
class KVPart:
    """One KV cache group's blocks in a grouped export: (num_layers, P, num_blocks, B, KVH, hd), the request's
    blocks from `first_block` on (those before are behind the group's sliding window: not carried)."""

    num_layers: int
    first_block: int
    num_blocks: int


@dataclass
class KVExport:
    layout: KVLayout
    num_tokens: int  # tokens the request's KV covers, from position 0
    # One group: (L, P, n, B, KVH, hd) (KVLayout.block_shape), the blocks from `first_block` on,
    # n = ceil(num_tokens / B) - first_block; slots past num_tokens are junk. Grouped (`parts`): 1-D, the
    # parts' tensors concatenated flat.
    blocks: torch.Tensor
    # Blocks before this one are not carried: they are behind every layer's sliding window (a model whose every
    # layer slides frees them, shared/engine/scheduler.py), so no query reads them again. 0 = all blocks.
    first_block: int = field(default=0, kw_only=True)
    parts: tuple[KVPart, ...] = field(default=(), kw_only=True)  # empty: one group (see the module doc)

    def __post_init__(self) -> None:
        if self.parts and self.blocks.numel() != sum(math.prod(self.part_shape(p)) for p in self.parts):
            raise ValueError(f"{self.blocks.numel()} values do not hold the parts {self.parts}")

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def part_shape(self, part: KVPart) -> tuple[int, ...]:
        lay = self.layout
        return (part.num_layers, lay.planes, part.num_blocks, lay.block_size, lay.num_held_kv_heads, lay.head_dim)

    def part_blocks(self, index: int) -> torch.Tensor:
        """Group `index`'s carried blocks, (L_g, P, n_g, B, KVH, hd): a view of `blocks`."""
        at = sum(math.prod(self.part_shape(p)) for p in self.parts[:index])
        shape = self.part_shape(self.parts[index])
        return self.blocks.view(-1)[at : at + math.prod(shape)].view(shape)

    def first_block_at(self, block_size: int, index: int | None = None) -> int:
        """The first block a pool of `block_size` needs to hold: the one holding the first carried token (of
        group `index` in a grouped export)."""
        first = self.first_block if index is None else self.parts[index].first_block
        return first * self.layout.block_size // block_size

    def write_into(self, pool: KVPool, block_ids: list[int]) -> None:
        """Fill `block_ids` of `pool` (one KV cache group's, or the only one) with this KV, re-cut to its block size."""
        pool.write(block_ids, self.reblock(pool.layout.block_size))

    def reblock(self, block_size: int, index: int | None = None) -> torch.Tensor:
        """The same tokens cut into blocks of another size: (L, P, n', block_size, KVH, hd), the blocks from
        `first_block_at(block_size)` on (group `index`'s in a grouped export). Tokens of that first block before
        the first carried one (behind the window) are zeros."""
        if index is None:
            blocks, first = self.blocks, self.first_block
        else:
            blocks, first = self.part_blocks(index), self.parts[index].first_block
        return recut(blocks, first, self.num_tokens, block_size)


def recut(blocks: torch.Tensor, first_block: int, num_tokens: int, block_size: int) -> torch.Tensor:
    """Blocks (L, P, n, b, KVH, hd) holding tokens first_block·b .. num_tokens - 1, cut into blocks of
    `block_size` from the one holding the first carried token on (zeros before it)."""
    L, planes, n, b, h, d = blocks.shape
    if block_size == b:
        return blocks
    start = first_block * b  # the first carried token
    new_first = start // block_size
    new_start = new_first * block_size
    tokens = blocks.reshape(L, planes, n * b, h, d)[:, :, : num_tokens - start]
    n_new = -(-num_tokens // block_size) - new_first
    padded = tokens.new_zeros(L, planes, n_new * block_size, h, d)
    padded[:, :, start - new_start : start - new_start + tokens.shape[2]] = tokens
    return padded.view(L, planes, n_new, block_size, h, d)
