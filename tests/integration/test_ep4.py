"""Expert parallelism at 4 ranks (gloo, the tiny 8-expert Qwen3-MoE: 2 experts a rank, or 3 slots with 4 redundant
replicas), token-exact against one engine in float32 greedy:

- SPMD (run_on_ranks): every rank builds an Engine over its shard and runs the same requests, for both dispatch
  modes (all-reduce, all-to-all), with the default placement and with a planned one whose redundant slots put some
  experts on 2 or 3 ranks; the per-rank counters add up to the single engine's pairs and every rank works;
- a real worker group of 4 ranks (start_group, the leader's op stream) with --eplb: a rebalance forced
  mid-generation moves one slot per rank per layer (four ranks sending and receiving in one all_to_all), the
  tokens stay exact before, during and after, and every rank then holds the checkpoint's weights for its new slots.

Four spawned ranks on a 2-core machine take a minute: the slow tier (make test-slow)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EplbConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.loader import load_model
from shared.parallel.group_engine import start_group
from shared.parallel.launch import run_on_ranks
from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement, plan_placement
from shared.worker.heartbeat import beat_facts
from tests.ep_groups import ep_config, random_prompts

pytestmark = pytest.mark.slow  # four spawned ranks per scenario (make test-slow)

EP, REDUNDANT = 4, 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("moe") / "demo", arch="qwen3_moe")  # 8 experts, 2 layers


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(seed, (29, 7, 40, 13, 1))


def _skewed_placement(model_dir) -> ExpertPlacement:
    """The planner's placement for a skewed load (expert 0 hottest, then 5): 12 slots over 4 ranks, the hot experts
    replicated on several ranks, each layer its own."""
    layers = sorted(load_model(model_dir).sparse_layers())
    stats = {
        layer: [400 - 40 * ((e + 5 * k) % 8) if e != 5 else 300 for e in range(8)] for k, layer in enumerate(layers)
    }
    placement = plan_placement(stats, ep=EP, redundant=REDUNDANT, num_experts=8)
    assert any(sum(e in slots for slots in ranks) >= 2 for ranks in placement.layers.values() for e in range(8)), (
        "the plan should replicate some expert"
    )
    return placement


def _generate(group: RankGroup, model_dir: str, runs: list[tuple[str, str | None]]) -> list[dict]:
    """Rank `group.rank`: generate the prompts at EP 4 once per (dispatch mode, placement file)."""
    results = []
    for mode, placement in runs:
        engine = Engine.build(
            ep_config(model_dir, ep=group.world, ep_dispatch=EPDispatch(mode), expert_placement=placement), group=group
        )
        engine.model.take_expert_load()
        tokens = engine.generate(_prompts(1), GREEDY)
        integrity, load, rank_load = beat_facts(engine)
        assert integrity is None
        results.append({"tokens": tokens, "load": load, "rank_load": rank_load and rank_load.per_rank})
    return results


def test_greedy_generation_at_ep4_is_token_exact_with_and_without_redundant_slots(model_dir, tmp_path) -> None:
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(_skewed_placement(model_dir).to_json()))
    runs = [(str(mode), p) for p in (None, str(placement)) for mode in EPDispatch]
    ranks = run_on_ranks(EP, _generate, (str(model_dir), runs), timeout_s=240)

    single = Engine.build(ep_config(model_dir))
    single.model.take_expert_load()
    want = single.generate(_prompts(1), GREEDY)
    _, want_load, _ = beat_facts(single)
    pairs = sum(sum(c) for c in want_load.values())
    for (mode, p), got in zip(runs, ranks[0], strict=True):
        where = f"{mode} {'planned' if p else 'default'}"
        assert got["tokens"] == want, where
        assert got["load"] == want_load, where  # the router is replicated: the leader's counters are the group's
        assert sum(got["rank_load"]) == pairs and min(got["rank_load"]) > 0, (where, got["rank_load"])
    assert all(r == ranks[0] for r in ranks[1:]), "every rank samples the same tokens"


def _swapped(placement: ExpertPlacement) -> ExpertPlacement:
    """Every layer: two disjoint pairs of ranks ((0, 1), (2, 3) in one layer, (1, 2), (3, 0) in the next) each trade
    one expert that only one of the two holds: every rank sends one slot and receives one, in one all_to_all."""
    layers = {}
    for k, (layer, ranks) in enumerate(sorted(placement.layers.items())):
        new = [list(slots) for slots in ranks]
        for a, b in ((0, 1), (2, 3)) if k % 2 == 0 else ((1, 2), (3, 0)):
            give = next(e for e in ranks[a] if e not in ranks[b])
            take = next(e for e in ranks[b] if e not in ranks[a])
            new[a][ranks[a].index(give)] = take
            new[b][ranks[b].index(take)] = give
        layers[layer] = new
    return ExpertPlacement(placement.ep, placement.num_experts, layers)


def test_a_forced_rebalance_mid_generation_at_ep4_keeps_tokens_exact(model_dir) -> None:
    deaths: list[tuple[int, int | None]] = []
    eplb = EplbConfig(enabled=True, window_steps=8, interval_s=3600.0, redundant=REDUNDANT, min_gain=0.05)
    group = start_group(
        ep_config(model_dir, ep=EP, eplb=eplb, ep_dispatch=EPDispatch.ALLTOALL),
        on_death=lambda rank, status: deaths.append((rank, status)),
    )
    try:
        rebalancer = group.rebalancer
        assert rebalancer is not None
        before = rebalancer.placement
        assert before.ep == EP and before.slots_per_rank == (8 + REDUNDANT) // EP
        target = _swapped(before)
        layers = len(before.layers)

        engine, prompts = group.engine, _prompts(2)
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p, GREEDY)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        phases, step = [], 0
        while engine.has_unfinished():
            if step == 2:
                rebalancer.request(target)
            moving = rebalancer.moving
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            phases.append("after" if rebalancer.history else "during" if moving else "before")
            step += 1
        assert [out[rid] for rid in ids] == Engine.build(ep_config(model_dir)).generate(prompts, GREEDY)
        assert {"before", "during", "after"} <= set(phases), phases
        assert phases.count("during") == len(before.layers)  # one layer staged per boundary, the old one serving

        plan = rebalancer.history[-1]
        assert rebalancer.placement == target
        # exactly the traded slots changed, one per rank per layer (the plan is aligned: kept experts stay put)
        changed = sum(
            o != n
            for layer in before.layers
            for old, new in zip(before.layers[layer], rebalancer.placement.layers[layer], strict=True)
            for o, n in zip(old, new, strict=True)
        )
        assert changed == EP * layers == len(plan.changes)
        stats = rebalancer.take_stats()
        assert stats.rebalances == 1 and stats.bytes_moved == changed * 3 * 32 * 64 * 4  # gate_up + down, float32

        group.ops.sync()
        full = {
            k: m.experts.gate_up.double().sum((1, 2)).tolist() for k, m in load_model(model_dir).sparse_layers().items()
        }
        held = asyncio.run(group.agents.call_all("expert_slots", dict.fromkeys(range(EP))))
        for rank, rank_layers in held.items():
            for layer, slots in rank_layers.items():
                assert [e for e, _ in slots] == rebalancer.placement.layers[layer][rank]
                assert [pytest.approx(full[layer][e]) for e, _ in slots] == [s for _, s in slots]
    finally:
        group.close()
    assert not deaths, f"a follower died: {deaths}"
