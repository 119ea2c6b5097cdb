"""A worker group's engines: the leader's `Engine` drives R ranks; its followers mirror every step.

`start_group(config)` is called by the worker process (or `pdserve generate`), which becomes rank 0: it
spawns ranks 1..R-1 (launch.py; they die with it), each builds the same `Engine` for its own device and cores
(the KV plan agreed across ranks: the smallest), and then:

- the leader's engine is the one the worker runtime drives (scheduling, sampling, NATS, registry): its
  runner's model call and its pool's writes go through the op stream (ops.py) to every follower first;
- each follower runs `follow`: the leader's ops on its model and pool, until `stop` or the leader's death,
  with its rank agent (agents.py) answering the leader's calls in a side thread.

Failure (watch.py): a follower that exits takes the leader down within moments; one that hangs makes the
leader's next collective time out (config.group_timeout_s); a leader that dies closes the followers' channels
(and their parent-death signal kills them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from shared.engine.build_thread import on_a_passing_thread
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.kv.rank_agents import register_rank_kv
from shared.parallel.eplb import ExpertRebalancer
from shared.parallel.launch import local_rendezvous, spawn_followers
from shared.parallel.ops import LeaderOps, MirroredKVPool, RankState, follow
from shared.parallel.watch import FollowerWatch, exit_now
from shared.ranklink.agents import GroupAgents, RankAgent, StagedKv, pool_digest
from shared.ranklink.channel import ChannelAddress, ChannelServer, dial
from shared.sharding.group import RankGroup
from shared.sharding.layout import ParallelLayout

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a follower's start: a fresh interpreter importing torch, then its model load


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs: its device (one GPU per rank), its torch threads and its CPU cores (None: as
    inherited)."""

    device: str
    threads: int | None
    cores: tuple[int, ...] | None


def rank_placements(config: EngineConfig, world: int, available: list[int] | None = None) -> list[RankPlacement]:
    """Rank k: on CUDA the k-th GPU from config.device's (cuda:N → cuda:N+k); on CPU the k-th of `world`
    equal runs of this process's cores (`available`: its affinity), with config.threads split between the
    ranks (else one thread per core of its own). Fewer cores than ranks: no pinning, threads split."""
    if config.device.startswith("cuda"):
        base = int(config.device.partition(":")[2] or 0)
        return [RankPlacement(f"cuda:{base + k}", config.threads, None) for k in range(world)]
    if available is None:
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_threads = max(1, config.threads // world) if config.threads else None
    if len(available) < world:
        return [RankPlacement(config.device, per_threads or 1, None) for _ in range(world)]
    per = len(available) // world
    runs = [tuple(available[k * per : (k + 1) * per]) for k in range(world)]
    return [RankPlacement(config.device, per_threads or len(run), run) for run in runs]


def _place(p: RankPlacement) -> set[int] | None:
    """Pin this process to its rank's cores; → the affinity it had (None where nothing was pinned)."""
    if p.cores is None or not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, p.cores)
    return before


def _unplace(before: set[int] | None) -> None:
    if before is not None:
        os.sched_setaffinity(0, before)


def _rank_config(config: EngineConfig, p: RankPlacement) -> EngineConfig:
    return dataclasses.replace(config, device=p.device, threads=p.threads)


def _register_builtins(agent: RankAgent, state: RankState) -> None:
    """Handlers every rank answers: staging imported KV, and the diagnostics the tests and `ps` read."""

    async def stage_kv(payload):
        key, kv = payload
        state.staged.stage(key, kv)

    async def unstage_kv(key):
        return state.staged.drop(key)

    async def digest(_):
        return pool_digest(state.pool.tensor)

    async def op_counts(_):
        return dict(state.counts)

    async def pid(_):
        return os.getpid()

    async def expert_slots(_):  # per sparse layer: this rank's logical expert of each slot, and its weights
        return {
            i: [(e, moe.experts.gate_up[s].double().sum().item()) for s, e in enumerate(moe.experts.slots)]
            for i, moe in state.model.sparse_layers().items()
        }

    register_rank_kv(agent, state.pool, state.staged)  # the KV hand-off between groups (kv.serve, kv.puller)
    for name, handler in (
        ("stage_kv", stage_kv),
        ("unstage_kv", unstage_kv),
        ("pool_digest", digest),
        ("op_counts", op_counts),
        ("pid", pid),
        ("expert_slots", expert_slots),
    ):
        agent.register(name, handler)


@dataclass
class WorkerGroup:
    """The leader's handle on its running group."""

    engine: Engine  # the leader's: drive it like any engine
    layout: ParallelLayout
    agents: GroupAgents
    ops: LeaderOps
    procs: list[BaseProcess]  # followers, rank 1.. in order
    watch: FollowerWatch
    channels: list[socket.socket]

    @property
    def pids(self) -> list[int]:
        """Every rank's process id, the leader's first."""
        return [os.getpid(), *(p.pid or 0 for p in self.procs)]

    rebalancer: ExpertRebalancer | None = None  # live expert re-placement (--eplb), the one ops.rebalancer runs
    # the leader's process affinity before it was pinned to rank 0's cores: back on close (a library caller, a
    # test run, goes on in the same process)
    leader_affinity: set[int] | None = None

    def close(self, timeout_s: float = 10.0) -> None:
        """A planned stop: the followers leave their loops and exit; the leader's process is unpinned."""
        _unplace(self.leader_affinity)
        self.watch.disarm()
        self.ops.stop()
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(1)
        for sock in self.channels:
            sock.close()


def start_group(config: EngineConfig, on_death: Callable[[int, int | None], None] = exit_now) -> WorkerGroup:
    """Start the group `config.tp`/`config.ep` asks for, this process as its leader. `on_death(rank, status)`:
    what a follower's exit does (default: this process exits non-zero at once)."""
    layout = config.parallel
    if layout.single:
        raise ValueError("start_group is for tp or ep > 1; a single-rank engine is a plain Engine")
    placements = rank_placements(config, layout.world)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    # joining and the start-up agreements wait for the slowest rank's interpreter and model load
    rdv = local_rendezvous(layout.world, backend, config.group_timeout_s, max(START_TIMEOUT_S, config.group_timeout_s))
    server = ChannelServer()
    procs = spawn_followers(rdv, follower_main, (config, placements, server.address))
    watch = FollowerWatch(procs, on_death)
    affinity = None
    try:
        affinity = _place(placements[0])
        group = RankGroup.join(rdv, 0, local_host=rdv.host)
        conns = server.accept_all(list(range(1, layout.world)), rdv.start_timeout_s or START_TIMEOUT_S)
        # the leader's engine steps on its worker's engine thread: built on a passing thread, it leaves the main
        # thread no OpenMP pool (build_thread.py); the followers were spawned from here, whose exit they watch
        engine = on_a_passing_thread(lambda: Engine.build(_rank_config(config, placements[0]), group=group))
    except BaseException:
        _unplace(affinity)
        watch.disarm()
        for p in procs:
            p.kill()
        raise
    finally:
        server.close()
    state = RankState(engine.model, engine.pool, StagedKv())
    op_channels = [conns[(r, "ops")] for r in range(1, layout.world)]
    ops = LeaderOps(group, op_channels, state)
    rebalancer = None
    if config.eplb.enabled:  # the model loaded with the live placement's slots (group_model.load_rank_model)
        rebalancer = ExpertRebalancer(config.eplb, engine.model, config.prefix_cache_namespace or config.model)
        ops.rebalancer = rebalancer
    # A worker group's engine keeps one pool (KV cache groups are single-rank: kv_cache.py); `engine.pool` is
    # pools[0], so fork's copies and imports all go through the mirrored one and reach the followers.
    assert len(engine.pools) == 1, "a worker group's engine has one KV pool"
    engine.pools[0] = MirroredKVPool(engine.pool, ops)
    engine.runner.pool = engine.pool
    engine.runner.run_step = ops.step
    agent = RankAgent(0)
    _register_builtins(agent, state)
    followers = range(1, layout.world)
    agents = GroupAgents(
        agent, {r: conns[(r, "agent")] for r in followers}, {r: conns[(r, "events")] for r in followers}
    )
    group_handle = WorkerGroup(engine, layout, agents, ops, procs, watch, list(conns.values()), rebalancer, affinity)
    log.info(
        "worker group %s: ranks %s (pids %s) on %s",
        layout,
        list(range(layout.world)),
        group_handle.pids,
        [p.device for p in placements],
    )
    return group_handle


def follower_main(group: RankGroup, config: EngineConfig, placements: list[RankPlacement], address: ChannelAddress):
    """Rank k >= 1 (spawned; launch.py joined the group): build this rank's engine, serve the agent, follow."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{group.rank} %(name)s %(levelname)s %(message)s")
    placement = placements[group.rank]
    _place(placement)
    ops_channel = dial(address, group.rank, "ops", config.group_timeout_s)
    agent_channel = dial(address, group.rank, "agent", config.group_timeout_s)
    events_channel = dial(address, group.rank, "events", config.group_timeout_s)
    engine = Engine.build(_rank_config(config, placement), group=group)
    state = RankState(engine.model, engine.pool, StagedKv())
    agent = RankAgent(group.rank)
    agent.events_to(events_channel)
    _register_builtins(agent, state)
    agent.serve_in_thread(agent_channel)
    why = follow(group, ops_channel, state)
    log.info("rank %d: the step loop ends (%s) after %s", group.rank, why, dict(state.counts))
    if why == "leader gone":
        os._exit(1)
