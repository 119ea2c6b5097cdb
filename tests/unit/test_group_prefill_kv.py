"""A prefill group's held KV over the real agent channels, in one process: the follower rank's agent runs on its
own thread and loop (as in a spawned follower), talks to the leader over socket pairs, and reports each send's
start and end on its events channel. What is checked: the leader's `PrefillKv` frees a key exactly once, only after
every rank retired it, once the decode group's pulls all ended, or at the first failed one; cancels free too.
The same KvHandOff and RankKv serve a worker of one rank (test_handoff_ranks.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from types import SimpleNamespace

import torch

from shared.engine.kv_pool import KVLayout, KVPool
from shared.kv.held import Freed
from shared.kv.prefill_kv import PrefillKv
from shared.kv.rank_agents import AgentReports, on_rank_reports, register_rank_link
from shared.kv.rank_held import RankKv
from shared.kv.ranks import KvRanks
from shared.kv.registry import KvLocation
from shared.kv.reslice import group_record
from shared.ranklink.agents import GroupAgents, RankAgent, StagedKv
from shared.settings import KvTransferSettings
from shared.sharding.layout import kv_head_range
from tests.kv_locations import Registry

KVH, TP = 4, 2
MODEL = KVLayout(2, KVH, 3, 4, "float32")


def sync(test):
    """Run an async test on a fresh loop (the project has no async pytest plugin); fixtures pass through."""

    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def _rank_held(agent: RankAgent) -> RankKv:
    """A rank's RankKv on `agent` (kv.hold / kv.close / kv.retire, as register_rank_kv registers them, without a
    server), and a test handler that makes one send of heads on the rank's own loop."""
    layout = KVLayout(2, KVH, 3, 4, "float32", tuple(kv_head_range(KVH, TP, agent.rank)))
    pool = KVPool(layout, 8)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))

    held = RankKv(agent.rank, AgentReports(agent), pool=pool)
    register_rank_link(agent, held)

    async def send(p) -> list[int]:  # what a decode rank's pull does at this rank's transfer server
        kv = await held.begin_send_heads(p["key"], range(*p["heads"]), p["pulls"])
        await held.end_send(p["key"], p["ok"])
        return list(kv.blocks.shape)

    async def keys(_) -> list[str]:
        return held.held()

    agent.register("test.send", send)
    agent.register("test.keys", keys)
    return held


class FakeEngine:
    """What PrefillKv asks of the leader's engine: a held request's block table, and freeing it."""

    layout = KVLayout(2, KVH, 3, 4, "float32", (0, 1))

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.blocks = SimpleNamespace(blocks_for=lambda n: -(-n // 4))
        self.released: list[str] = []

        self.ranks_hold: dict[int, list[str]] = {}

    def release_kv(self, key: str) -> bool:
        assert not any(key in keys for keys in self.ranks_hold.values()), f"{key} freed while {self.ranks_hold}"
        self.released.append(key)
        return self.requests.pop(key, None) is not None


class Group:
    """Leader (rank 0, this loop) and one follower (rank 1, its own thread and loop) over socket pairs."""

    def __init__(self) -> None:
        agent_ours, agent_theirs = socket.socketpair()
        events_ours, events_theirs = socket.socketpair()
        self.sockets = [agent_ours, agent_theirs, events_ours, events_theirs]
        follower = RankAgent(1)
        follower.events_to(events_theirs)
        _rank_held(follower)
        follower.serve_in_thread(agent_theirs)
        leader = RankAgent(0)
        self.agents = GroupAgents(leader, {1: agent_ours}, {1: events_ours})
        _rank_held(leader)
        self.engine = FakeEngine()
        self.released = self.engine.released
        self.registry = Registry()
        ranks = KvRanks(self.agents, TP, StagedKv())
        self.kv = PrefillKv(KvTransferSettings(lease_s=60.0), self.engine, self._call, self.registry,  # pyright: ignore[reportArgumentType]
                            secret="s" * 16, model_name="m", ranks=ranks)  # fmt: skip
        self.kv.record = group_record(MODEL, TP, ["rank0:1", "rank1:1"])
        on_rank_reports(self.agents, self.kv.held)  # what start() does, without the servers

    async def _call(self, fn):
        """The engine thread: fn on the fake engine; a release checks first that no rank still holds the key."""
        self.engine.ranks_hold = await self.keys()  # what every rank holds as the engine call starts
        return fn(self.engine)

    async def keys(self) -> dict[int, list[str]]:
        return await self.agents.call_all("test.keys", {0: None, 1: None})

    async def wait_released(self, n: int) -> None:
        for _ in range(200):
            if len(self.released) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"released {self.released}, expected {n}")

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def _request(g: Group, key: str) -> None:
    """A finished prompt of 7 tokens holding blocks 6 and 1 (and a spare third one a pull must not copy)."""
    g.engine.requests[key] = SimpleNamespace(num_computed_tokens=7, block_table=[6, 1, 3])


def _loc(key: str) -> KvLocation:
    return KvLocation(key, "prefill-g", "rank0:1", 0, MODEL.fingerprint)


@sync
async def test_events_from_a_follower_and_the_leader_reach_the_handler(caplog) -> None:
    ours, theirs = socket.socketpair()
    follower = RankAgent(1)
    follower.events_to(theirs)
    agents = GroupAgents(RankAgent(0), {}, {1: ours})
    got: list[tuple[int, object]] = []
    seen = asyncio.Event()

    async def handler(rank: int, payload) -> None:
        got.append((rank, payload))
        if len(got) == 2:
            seen.set()

    agents.on_event("ping", handler)
    await follower.notify("ping", ("from", 1))
    await agents.local.notify("ping", ("from", 0))
    with caplog.at_level(logging.WARNING):
        await agents.local.notify("nobody-listens", None)
    await asyncio.wait_for(seen.wait(), 5)
    assert sorted(got) == [(0, ("from", 0)), (1, ("from", 1))]
    assert "no handler takes" in caplog.text
    ours.close()
    theirs.close()


@sync
async def test_freed_once_after_every_rank_sent_and_retired() -> None:
    g = Group()
    try:
        _request(g, "k")
        assert await g.kv.hold("k", "r", 0, _loc("k"))
        assert await g.keys() == {0: ["k"], 1: ["k"]}
        entry = g.registry.entries["k"]
        assert entry.group == g.kv.record and entry.num_tokens == 7  # the group's record travels with the location
        # a decode TP 1 rank's plan: heads 0-1 from rank 0, heads 2-3 from rank 1: two transfers in all
        shape = await g.agents.call(1, "test.send", {"key": "k", "heads": (2, 4), "pulls": 2, "ok": True})
        assert shape == [2, 2, 2, 4, 2, 3]  # (L, K|V, the key's 2 blocks, block size, 2 heads, head dim)
        await asyncio.sleep(0.05)
        assert g.released == [] and g.kv.count() == 1  # one of the two pulls
        await g.agents.call(0, "test.send", {"key": "k", "heads": (0, 2), "pulls": 2, "ok": True})
        await g.wait_released(1)
        assert g.kv.held.freed == {Freed.PULLED: 1} and g.kv.count() == 0 and "k" not in g.registry.entries
        assert await g.keys() == {0: [], 1: []}
    finally:
        g.close()


@sync
async def test_a_failed_send_on_the_follower_frees_on_every_rank_and_a_cancel_frees_too() -> None:
    g = Group()
    try:
        _request(g, "k")
        assert await g.kv.hold("k", "r", 0, _loc("k"))
        await g.agents.call(1, "test.send", {"key": "k", "heads": (2, 4), "pulls": 2, "ok": False})
        await g.wait_released(1)
        assert g.kv.held.freed == {Freed.SEND_FAILED: 1}
        _request(g, "c")
        assert await g.kv.hold("c", "rc", 3, _loc("c"))
        assert await g.kv.cancel("rc", lambda attempt: attempt <= 2) == 0  # a later attempt: not covered
        assert await g.kv.cancel("rc", lambda attempt: attempt <= 3) == 1
        await g.wait_released(2)
        assert g.kv.held.freed == {Freed.SEND_FAILED: 1, Freed.CANCELLED: 1} and await g.keys() == {0: [], 1: []}
    finally:
        g.close()
