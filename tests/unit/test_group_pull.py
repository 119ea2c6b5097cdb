"""The decode leader's side of a group pull: every rank pulls at once; one rank's failure (its reason, or its
agent call failing) makes every rank drop what it staged, and the reason comes back for the fallback."""

from __future__ import annotations

import asyncio
from typing import Any

from shared.engine.kv_pool import KVLayout
from shared.kv.rank_transfer import PullJob, pull_group_kv
from shared.kv.reslice import group_record
from shared.ranklink.agents import AgentError

RECORD = group_record(KVLayout(2, 2, 4, 4, "float32"), 2, ["p0:1", "p1:1"])


class Agents:
    """The leader's agents: each rank's kv.pull answer, every call recorded."""

    def __init__(self, answers: dict[int, str | None], gone: bool = False) -> None:
        self.answers, self.gone = answers, gone
        self.calls: list[tuple[str, dict[int, Any]]] = []

    async def call_all(self, name: str, payloads_by_rank: dict[int, Any]) -> dict[int, Any]:
        self.calls.append((name, payloads_by_rank))
        if name == "kv.pull" and self.gone:
            raise AgentError("rank 1 is gone (its agent channel closed during 'kv.pull')")
        return {rank: self.answers.get(rank) if name == "kv.pull" else None for rank in payloads_by_rank}


def test_all_staged_means_no_drop() -> None:
    agents = Agents({0: None, 1: None})
    assert asyncio.run(pull_group_kv(agents, 2, "r", RECORD)) is None
    ((name, payloads),) = agents.calls
    assert name == "kv.pull" and payloads == {0: PullJob("r", RECORD, 2), 1: PullJob("r", RECORD, 2)}


def test_one_rank_failing_drops_the_kv_on_every_rank() -> None:
    agents = Agents({0: None, 1: "transfer_failed: the pair broke"})
    assert asyncio.run(pull_group_kv(agents, 2, "r", RECORD)) == "rank 1: transfer_failed: the pair broke"
    assert agents.calls[-1] == ("kv.drop", {0: {"key": "r"}, 1: {"key": "r"}})


def test_a_rank_gone_during_the_pull_drops_too() -> None:
    agents = Agents({}, gone=True)
    assert "rank 1 is gone" in (asyncio.run(pull_group_kv(agents, 2, "r", RECORD)) or "")
    assert agents.calls[-1][0] == "kv.drop"
