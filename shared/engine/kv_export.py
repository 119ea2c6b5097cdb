"""One request's KV cache as a self-describing value: what a prefill engine hands to a decode engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.kv_pool import KVLayout


@dataclass
class KVExport:
    layout: KVLayout
    num_tokens: int  # tokens whose K/V is in `blocks`, from position 0
    blocks: torch.Tensor  # (L, P, n, B, KVH, hd) (KVLayout.block_shape), n = ceil(num_tokens / B); slots past
    # num_tokens are junk

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def reblock(self, block_size: int) -> torch.Tensor:
        """The same tokens cut into blocks of another size: (L, P, n', block_size, KVH, hd)."""
        if block_size == self.layout.block_size:
            return self.blocks
        L, planes, n, b, h, d = self.blocks.shape
        tokens = self.blocks.reshape(L, planes, n * b, h, d)[:, :, : self.num_tokens]
        n_new = -(-self.num_tokens // block_size)
        padded = tokens.new_zeros(L, planes, n_new * block_size, h, d)
        padded[:, :, : self.num_tokens] = tokens
        return padded.view(L, planes, n_new, block_size, h, d)
