"""A worker group of several ranks as the KV hand-off sees it (the group runtime hands it to the workers)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.ranklink.agents import GroupAgents, StagedKv


@dataclass(frozen=True)
class KvRanks:
    """The leader's handle on its ranks' hand-off: their agents (kv.* handlers, rank_agents.py), how many, and
    the leader's own staging (a decode group's pulled KV, referenced by the import)."""

    agents: GroupAgents
    tp: int
    staged: StagedKv
