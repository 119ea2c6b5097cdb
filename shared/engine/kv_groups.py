"""KV cache groups: the model's layers partitioned by sliding window, each group its own pool and blocks.

A block of a pool spans every layer of its group. When the layers differ in what they read (gpt-oss: even
layers slide over 128 tokens, odd ones see everything) one pool would keep the window layers' K/V of every
token for the full layers' sake. Split by window instead (vLLM's hybrid allocator, our own code):

- group 0 holds the full layers (when there are any), its table grows with the sequence;
- one group per distinct window W holds the layers of that window; the scheduler frees its blocks once they
  leave the window, so its live blocks per request stay near cdiv(W - 1, B) + 2 however long the sequence.

A model whose layers all attend the same way (all full, or all sliding: Mistral-style, where the largest
window frees blocks of the one pool) has one group, and runs exactly as before groups existed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from shared.engine.kv_pool import KVLayout


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers (model layer ids, ascending: the group pool's layer order) and the
    window behind which its blocks are freed (None: kept while the request runs)."""

    layers: tuple[int, ...]
    window: int | None

    def layout(self, model: KVLayout) -> KVLayout:
        """The group pool's layout: the model's, restricted to this group's layers."""
        if len(self.layers) == model.num_layers:
            return model
        windows = tuple(model.layer_windows[i] for i in self.layers) if model.layer_windows else ()
        return dataclasses.replace(model, num_layers=len(self.layers), layer_windows=windows)


@functools.cache
def kv_groups(num_layers: int, layer_windows: tuple[int | None, ...]) -> tuple[KVGroup, ...]:
    """The groups of a model with these per-layer windows (empty: all full). One group unless full and
    sliding layers mix; then the full layers first, then one group per window, smallest window first."""
    every = tuple(range(num_layers))
    if not layer_windows or None not in layer_windows:  # all full, or all sliding (freed by the largest window)
        windows = [w for w in layer_windows if w is not None]
        return (KVGroup(every, max(windows) if windows else None),)
    if all(w is None for w in layer_windows):
        return (KVGroup(every, None),)
    full = KVGroup(tuple(i for i in every if layer_windows[i] is None), None)
    sliding = sorted({w for w in layer_windows if w is not None})
    return (full, *(KVGroup(tuple(i for i in every if layer_windows[i] == w), w) for w in sliding))


def window_live_blocks(window: int, block_size: int, query_tokens: int = 1) -> int:
    """Blocks a window group holds for one request at most while `query_tokens` queries run at once (1: a
    decode step): the W - 1 keys behind the first query and the queries' own, on a block grid they may straddle."""
    return -(-(window - 1 + query_tokens) // block_size) + 1
