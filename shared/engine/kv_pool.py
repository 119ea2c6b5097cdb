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
    """What two engines must agree on to exchange KV blocks.

    A tensor-parallel rank's pool holds only its KV heads: `num_kv_heads` is the model's count, `kv_heads` which
    of them this pool holds (in pool order; the pool tensor's head dimension is `num_held_kv_heads`). Default:
    all of them (a single-rank engine)."""

    num_layers: int
    num_kv_heads: int  # the model's KV heads (all ranks together)
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    # Global ids of the KV heads this pool holds, in pool order (a tensor-parallel rank holds a slice);
    # empty = all `num_kv_heads`. Not part of the fingerprint: slices of one model's KV are compatible.
    kv_heads: tuple[int, ...] = ()
    # Per layer, its sliding window (None = full attention; empty = every layer full): ModelConfig.layer_windows.
    # Part of the fingerprint: the same shapes under other windows are other KV (a window layer's K/V of a
    # token is only read by the queries within the window; the full layers' by all).
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= h < self.num_kv_heads for h in self.kv_heads) or len(set(self.kv_heads)) != len(self.kv_heads):
            raise ValueError(f"kv_heads {self.kv_heads} must be distinct ids below num_kv_heads={self.num_kv_heads}")

    @property
    def held_kv_heads(self) -> tuple[int, ...]:
        """The global KV head ids in this pool, in order (all of them unless `kv_heads` names a slice)."""
        return self.kv_heads or tuple(range(self.num_kv_heads))

    @property
    def num_held_kv_heads(self) -> int:
        """The pool tensor's KV-head dimension."""
        return len(self.held_kv_heads)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_held_kv_heads * self.head_dim * itemsize

    @property
    def fingerprint(self) -> str:
        """Stable id of the model's token-level KV shape (block size excluded: blocks can be re-cut on import;
        which heads a pool holds excluded too: equal fingerprints mean the same model shape, and pools of
        different tensor-parallel ranks compare `held_kv_heads` to see what they can exchange)."""
        key = f"{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:{self.dtype}"
        if self.layer_windows:  # absent without windows: the fingerprints of full-attention models are unchanged
            key += ":windows=" + ",".join("full" if w is None else str(w) for w in self.layer_windows)
        return hashlib.sha256(key.encode()).hexdigest()[:16]


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_held_kv_heads, layout.head_dim)
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
