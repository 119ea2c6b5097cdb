"""Numbers a worker group's ranks must agree on before they run in lockstep (the KV pool's block count: each
rank plans its own from its own memory, and the group can only use what its smallest rank holds)."""

from __future__ import annotations

import torch

from shared.parallel.group import RankGroup


def agree_min(group: RankGroup, n: int) -> int:
    """The smallest of every rank's `n` (the identity on a group of one). Every rank must call it."""
    if group.world == 1:
        return n
    return int(group.all_gather(torch.tensor([n], dtype=torch.int64), dim=0).min().item())
