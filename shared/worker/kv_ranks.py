"""Where a worker finds its group of several ranks for the KV hand-off: the one place that reads the group handle."""

from __future__ import annotations

from shared.kv.ranks import KvRanks
from shared.parallel.group_engine import WorkerGroup


def kv_ranks(group: WorkerGroup | None) -> KvRanks | None:
    """The group this worker leads when its ranks hold KV head slices (tp > 1), else None (a rank of one)."""
    if group is None or group.layout.tp <= 1:
        return None
    return KvRanks(group.agents, group.layout.tp, group.ops.state.staged)
