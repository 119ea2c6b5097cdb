"""What a model layer needs to know to hold its tensor-parallel shard: the degree, this rank's index, the
group's all-reduce, and how a checkpoint tensor's rows or columns are cut for this rank.

`TensorShard.SINGLE` (tp = 1) is today's model: every range is the whole tensor, `source()` is () (the
loader reads the whole tensor, as before), `all_reduce_` returns its argument untouched.

Ownership (which heads, which rows) comes from shared/sharding/layout.py, so the model, the KV pool and the
hand-off cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from shared.sharding.group import RankGroup
from shared.sharding.layout import LayoutError, ParallelLayout, split_range


@dataclass(frozen=True)
class TensorShard:
    group: RankGroup
    tp: int = 1  # tensor-parallel degree (the group size, or 1 when only experts are parallel)

    SINGLE: ClassVar[TensorShard]  # tp = 1: set below the class

    @classmethod
    def of(cls, group: RankGroup | None, layout: ParallelLayout | None) -> TensorShard:
        """The shard of `group`'s rank under `layout`; both None = the whole model on one rank."""
        layout = layout or ParallelLayout()
        group = group or RankGroup.single()
        if group.world != layout.world:
            raise LayoutError(f"layout {layout} needs {layout.world} ranks, the group has {group.world}")
        return cls(group, layout.tp) if layout.tp > 1 else cls.SINGLE

    @property
    def rank(self) -> int:
        """This rank's index among the tensor-parallel ranks (the group rank: each degree is 1 or the group)."""
        return self.group.rank if self.tp > 1 else 0

    @property
    def split(self) -> bool:
        return self.tp > 1

    def part(self, size: int, what: str) -> range:
        """This rank's contiguous 1/tp of `size` (intermediate sizes); LayoutError when it does not divide."""
        return split_range(size, self.tp, self.rank, what)

    def source(self, rows: range | slice | None = None, cols: range | slice | None = None) -> tuple:
        """The index of a checkpoint tensor this rank reads (rows and/or columns); () = the whole tensor."""
        if not self.split:
            return ()
        r, c = _as_slice(rows), _as_slice(cols)
        return (r,) if cols is None else (r, c)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (row-parallel outputs); the identity at tp = 1."""
        return self.group.all_reduce_(t) if self.split else t


TensorShard.SINGLE = TensorShard(RankGroup.single(), 1)


def _as_slice(r: range | slice | None) -> slice:
    if r is None:
        return slice(None)
    if isinstance(r, range):
        return slice(r.start, r.stop)
    return r
