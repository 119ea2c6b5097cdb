"""The physical KV cache: one preallocated tensor per worker, addressed by block id.

Shape (L, P, N, B, KVH, hd): layers, planes, blocks, tokens per block, KV heads, entry width. Ordinary attention
caches two planes (K|V) of head_dim per KV head; multi-head latent attention (DeepSeek) caches one plane, one
"head" (the latent is shared by all query heads) of kv_lora_rank + qk_rope_head_dim values: (L, 1, N, B, 1, W).
Which blocks belong to whom is the block manager's business; this module only stores and copies bytes.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from shared.engine.shared_pool import PoolHandle, SharedPoolMemory

if TYPE_CHECKING:
    from shared.model.config import ModelConfig

log = logging.getLogger(__name__)

# A read whose runs of consecutive blocks average at least this many blocks copies each run as one strided
# slice, instead of index_select over the block ids, which copies block by block (the shared-memory send's
# gather: `kv_pull_profile.py --shm`, phase "gather into the segment").
RUN_COPY_MIN_BLOCKS = 4


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on to exchange KV blocks.

    A tensor-parallel rank's pool holds only its KV heads: `num_kv_heads` is the model's count, `kv_heads` which
    of them this pool holds (in pool order; the pool tensor's head dimension is `num_held_kv_heads`). Default:
    all of them (a single-rank engine)."""

    num_layers: int
    num_kv_heads: int  # the model's KV heads (all ranks together); 1 for a latent cache
    head_dim: int  # values per token, head and plane: the head dim, or a latent cache's entry width
    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    # Global ids of the KV heads this pool holds, in pool order (a tensor-parallel rank holds a slice);
    # empty = all `num_kv_heads`. Not part of the fingerprint: slices of one model's KV are compatible.
    kv_heads: tuple[int, ...] = ()
    # Per layer, its sliding window (None = full attention; empty = every layer full): ModelConfig.layer_windows.
    # Part of the fingerprint: the same shapes under other windows are other KV (a window layer's K/V of a
    # token is only read by the queries within the window; the full layers' by all).
    layer_windows: tuple[int | None, ...] = ()
    planes: int = 2  # 2: K and V; 1: a latent cache (MLA), one entry per token holding what K and V derive from

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise ValueError(f"a KV layout has 1 (latent) or 2 (K|V) planes, not {self.planes}")
        if any(not 0 <= h < self.num_kv_heads for h in self.kv_heads) or len(set(self.kv_heads)) != len(self.kv_heads):
            raise ValueError(f"kv_heads {self.kv_heads} must be distinct ids below num_kv_heads={self.num_kv_heads}")

    @classmethod
    def for_model(cls, mc: ModelConfig, block_size: int, dtype: str, kv_heads: tuple[int, ...] = ()) -> KVLayout:
        """The cache layout of model `mc`: K|V per KV head, or MLA's one latent entry (ModelConfig.kv_planes)."""
        return cls(
            mc.num_layers, mc.num_kv_heads, mc.kv_width, block_size, dtype, kv_heads,
            planes=mc.kv_planes, layer_windows=mc.layer_windows,
        )  # fmt: skip

    @property
    def held_kv_heads(self) -> tuple[int, ...]:
        """The global KV head ids in this pool, in order (all of them unless `kv_heads` names a slice)."""
        return self.kv_heads or tuple(range(self.num_kv_heads))

    @property
    def num_held_kv_heads(self) -> int:
        """The pool tensor's KV-head dimension."""
        return len(self.held_kv_heads)

    @property
    def kind(self) -> str:
        return "kv" if self.planes == 2 else "latent"

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of `num_blocks` blocks of every layer, as the pool holds and exports them: (L, P, n, B, KVH, hd)."""
        return (self.num_layers, self.planes, num_blocks, self.block_size, self.num_held_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * self.planes * self.block_size * self.num_held_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes in this pool (all layers): what a hand-off moves per prompt token."""
        return self.bytes_per_block // self.block_size

    @property
    def fingerprint(self) -> str:
        """Stable id of the model's token-level KV shape (block size excluded: blocks can be re-cut on import;
        which heads a pool holds excluded too: equal fingerprints mean the same model shape, and pools of
        different tensor-parallel ranks compare `held_kv_heads` to see what they can exchange). A latent cache's
        key names its kind: a latent of width W never matches K|V caches of head dim W; K|V keys are unchanged
        from before latent caches existed, so workers of both versions still agree on them."""
        key = f"{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:{self.dtype}"
        if self.kind != "kv":
            key += f":{self.kind}"
        if self.layer_windows:  # absent without windows: the fingerprints of full-attention models are unchanged
            key += ":windows=" + ",".join("full" if w is None else str(w) for w in self.layer_windows)
        return hashlib.sha256(key.encode()).hexdigest()[:16]


class PoolFill(Protocol):
    """KV that writes itself into a pool's blocks: kv_export.KVExport (re-cut to the pool's block size), or a
    borrowed one copying from its lender's pool (borrowed_kv.py). Declared here, so the pool needs no import of
    the export (which imports the pool)."""

    def write_into(self, pool: KVPool, block_ids: list[int]) -> None: ...


class KVPool:
    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", shared: bool = False
    ) -> None:
        """shared: a host pool in a memfd that a same-host peer can map (shared_pool.py); `memory` is then set."""
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape, dtype = layout.block_shape(num_blocks), layout.torch_dtype
        self.memory: SharedPoolMemory | None = None
        if shared and torch.device(device).type != "cpu":
            raise ValueError(f"only a host pool can be shared, not one on {device}")
        if shared:
            try:
                self.memory = SharedPoolMemory.create(math.prod(shape) * dtype.itemsize)
            except OSError as e:  # no memfds or seals here, or no memory for one: the pool works all the same
                log.warning("the KV pool cannot live in shared memory (%s): a private pool, not lent in place", e)
        if self.memory is not None:
            self.tensor = self.memory.tensor(shape, dtype)  # zero-filled, as a fresh memfd is
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    def handle(self) -> PoolHandle | None:
        """How a same-host peer maps this pool (shared_pool.attach_pool); None for a pool not in shared memory."""
        return None if self.memory is None else self.memory.handle(self.num_blocks)

    def layer_caches(self) -> list[torch.Tensor]:
        """Per layer, a (P, N, B, KVH, hd) view (K and V, or the latent) that the model writes into."""
        return list(self.tensor.unbind(0))

    def read(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy of the given blocks for all layers: (L, P, n, B, KVH, hd), into `out` when given
        (reused memory: no first-touch page faults)."""
        runs = block_runs(block_ids)
        if len(runs) * RUN_COPY_MIN_BLOCKS <= len(block_ids):  # long runs: a strided copy per run
            if out is None:
                t = self.tensor
                out = torch.empty((*t.shape[:2], len(block_ids), *t.shape[3:]), dtype=t.dtype, device=t.device)
            at = 0
            for first, count in runs:
                out[:, :, at : at + count].copy_(self.tensor[:, :, first : first + count])
                at += count
            return out
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensor.device)
        if out is None:
            return self.tensor.index_select(2, index)
        return torch.index_select(self.tensor, 2, index, out=out)

    @property
    def num_planes(self) -> int:
        """Planes per layer and block (K and V: 2)."""
        return self.tensor.shape[1]

    def segment(self, layer: int, plane: int, start: int, count: int) -> torch.Tensor:
        """Blocks [start, start + count) of one layer's plane: a contiguous view (no copy) of shape
        (count, B, KVH, hd). A contiguous run of a request's blocks is one segment per (layer, plane)."""
        return self.tensor[layer, plane, start : start + count]

    def read_layer(self, layer: int, block_ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """Copy of the given blocks of one layer, all planes: into `out`, of shape (planes, n, B, KVH, hd)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensor.device)
        return torch.index_select(self.tensor[layer], 1, index, out=out)

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fill the given blocks from `data` of shape (L, P, n, B, KVH, hd)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensor.device)
        self.tensor.index_copy_(2, index, data.to(device=self.tensor.device, dtype=self.tensor.dtype))

    def write_export(self, block_ids: list[int], kv: PoolFill) -> None:
        """Fill the given blocks with an imported request's KV (re-cut to this pool's block size)."""
        kv.write_into(self, block_ids)  # a borrowed KV copies from the lender's pool straight in (borrowed_kv.py)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block (all layers and planes) onto another, on the device (a forked sequence's own copy of a
        partially filled prompt block)."""
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """The ids as maximal runs of consecutive blocks, in order: [(first id, count), ...]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
