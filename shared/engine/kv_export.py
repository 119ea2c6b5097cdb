"""One request's KV cache as a self-describing value: what a prefill engine hands to a decode engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine.kv_pool import KVLayout


@dataclass
class KVExport:
    layout: KVLayout
    num_tokens: int  # tokens the request's KV covers, from position 0
    # (L, 2, n, B, KVH, hd): the blocks from `first_block` on, n = ceil(num_tokens / B) - first_block; slots
    # past num_tokens are junk
    blocks: torch.Tensor
    # Blocks before this one are not carried: they are behind every layer's sliding window (a model whose every
    # layer slides frees them, shared/engine/scheduler.py), so no query reads them again. 0 = all blocks.
    first_block: int = field(default=0, kw_only=True)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def first_block_at(self, block_size: int) -> int:
        """The first block a pool of `block_size` needs to hold: the one holding the first carried token."""
        return self.first_block * self.layout.block_size // block_size

    def reblock(self, block_size: int) -> torch.Tensor:
        """The same tokens cut into blocks of another size: (L, 2, n', block_size, KVH, hd), the blocks from
        `first_block_at(block_size)` on. Tokens of that first block before the first carried one (behind the
        window) are zeros."""
        if block_size == self.layout.block_size:
            return self.blocks
        L, two, n, b, h, d = self.blocks.shape
        start = self.first_block * b  # the first carried token
        new_start = self.first_block_at(block_size) * block_size
        tokens = self.blocks.reshape(L, two, n * b, h, d)[:, :, : self.num_tokens - start]
        n_new = -(-self.num_tokens // block_size) - self.first_block_at(block_size)
        padded = tokens.new_zeros(L, two, n_new * block_size, h, d)
        padded[:, :, start - new_start : start - new_start + tokens.shape[2]] = tokens
        return padded.view(L, two, n_new, block_size, h, d)
