"""The physical KV cache: one preallocated tensor per worker, addressed by block id.

Shape (L, 2, N, B, KVH, hd): layers, K|V, blocks, tokens per block, KV heads, head dim. Which blocks
belong to whom is the block manager's business; this module only stores and copies bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.engine.kv_export import KVExport


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on to exchange KV blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def fingerprint(self) -> str:
        """Stable id of the token-level layout (block size excluded: blocks can be re-cut on import)."""
        key = f"{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:{self.dtype}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.tensor = torch.zeros(shape, dtype=layout.torch_dtype, device=device)

    def layer_caches(self) -> list[torch.Tensor]:
        """Per layer, a (2, N, B, KVH, hd) view (K and V) that the model writes into."""
        return list(self.tensor.unbind(0))

    def read(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy of the given blocks for all layers: (L, 2, n, B, KVH, hd), into `out` when given
        (reused memory: no first-touch page faults)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensor.device)
        if out is None:
            return self.tensor.index_select(2, index)
        return torch.index_select(self.tensor, 2, index, out=out)

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fill the given blocks from `data` of shape (L, 2, n, B, KVH, hd)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensor.device)
        self.tensor.index_copy_(2, index, data.to(device=self.tensor.device, dtype=self.tensor.dtype))

    def write_export(self, block_ids: list[int], kv: KVExport) -> None:
        """Fill the given blocks with an imported request's KV (re-cut to this pool's block size)."""
        self.write(block_ids, kv.reblock(self.layout.block_size))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block (all layers, K and V) onto another, on the device (a forked sequence's own copy of a
        partially filled prompt block)."""
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])
