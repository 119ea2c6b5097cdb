"""Live expert re-placement (--eplb) in a real worker group of 2 EP ranks (gloo, shared/parallel/eplb.py): a
rebalance forced mid-generation gives the single engine's float32 greedy tokens before, during (the layers
staged one per step while the old placement serves, or all at one step) and after the swap; only the changed
slots move, their bytes counted exactly, and every rank then holds the checkpoint's weights for its new slots;
the planner moves again from the window's real load; a rank killed during a weight move takes the group down
with its old placement."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, EplbConfig, Quantization
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.loader import load_model
from shared.parallel.group_engine import WorkerGroup, start_group
from shared.sharding.placement import ExpertPlacement
from tests.ep_groups import ep_config, random_prompts

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
EP, REDUNDANT = 2, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("moe") / "demo", arch="qwen3_moe")  # 8 experts


def _eplb_config(model_dir, **kw) -> EngineConfig:
    eplb = EplbConfig(enabled=True, window_steps=8, interval_s=3600.0, redundant=REDUNDANT, min_gain=0.05)
    return ep_config(model_dir, ep=EP, eplb=eplb, **kw)


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(seed, (29, 7, 40, 13))


def _expected(model_dir, prompts) -> list[list[int]]:
    return Engine.build(ep_config(model_dir)).generate(prompts, GREEDY)


def _run(group: WorkerGroup, prompts, at_step=None) -> tuple[list[list[int]], list[str]]:
    """Generate, calling `at_step(n)` before step n; → the tokens and each step's phase of the rebalance."""
    engine, rebalancer = group.engine, group.rebalancer
    assert rebalancer is not None
    ids = [f"r{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    phases, step = [], 0
    swapped = len(rebalancer.history)
    while engine.has_unfinished():
        if at_step is not None:
            at_step(step)
        moving = rebalancer.moving
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        phases.append("after" if len(rebalancer.history) > swapped else "during" if moving else "before")
        step += 1
    return [out[rid] for rid in ids], phases


def _shuffled(placement: ExpertPlacement) -> ExpertPlacement:
    """Every layer's slots rotated by one expert between the ranks (replicas stay on distinct ranks)."""
    layers = {}
    for layer, (a, b) in placement.layers.items():
        only_a = [e for e in a if e not in b]
        only_b = [e for e in b if e not in a]
        a2 = [only_b[0] if e == only_a[0] else e for e in a]
        b2 = [only_a[0] if e == only_b[0] else e for e in b]
        layers[layer] = [a2, b2]
    return ExpertPlacement(placement.ep, placement.num_experts, layers)


@pytest.fixture(scope="module")
def group(model_dir):
    deaths: list[tuple[int, int | None]] = []
    g = start_group(_eplb_config(model_dir), on_death=lambda rank, status: deaths.append((rank, status)))
    yield g
    g.close()
    assert not deaths, f"a follower died during the tests: {deaths}"


def test_a_forced_rebalance_mid_generation_keeps_tokens_and_moves_only_changed_slots(model_dir, group) -> None:
    rebalancer = group.rebalancer
    assert rebalancer is not None
    before = rebalancer.placement
    assert before.slots_per_rank == (8 + REDUNDANT) // EP  # the redundant slots are there from the start
    target = _shuffled(before)
    changed = sum(
        o != n
        for layer in before.layers
        for old, new in zip(before.layers[layer], target.layers[layer], strict=True)
        for o, n in zip(old, new, strict=True)
    )
    layers = len(before.layers)
    assert changed == 2 * layers  # one slot per rank per layer

    prompts = _prompts(1)
    tokens, phases = _run(group, prompts, at_step=lambda n: n == 3 and rebalancer.request(target))
    assert tokens == _expected(model_dir, prompts)
    assert {"before", "during", "after"} <= set(phases), phases
    # planned at one boundary, then one layer staged per boundary (those steps still run the old placement), then
    # swapped at the next (that step runs the new one)
    assert phases.count("during") == layers

    assert rebalancer.placement == target
    stats = rebalancer.take_stats()
    i, d = 32, 64  # the tiny model's expert intermediate size and hidden size: gate_up (2I, D) + down (D, I)
    assert stats.rebalances == 1 and stats.bytes_moved == changed * 3 * i * d * 4
    assert len(stats.pauses_s) == layers + 1

    # every rank holds the checkpoint's weights of the experts its new slots name
    group.ops.sync()
    full = {
        k: m.experts.gate_up.double().sum((1, 2)).tolist() for k, m in load_model(model_dir).sparse_layers().items()
    }
    held = asyncio.run(group.agents.call_all("expert_slots", {0: None, 1: None}))
    for rank, rank_layers in held.items():
        for layer, slots in rank_layers.items():
            assert [e for e, _ in slots] == target.layers[layer][rank]
            assert [pytest.approx(full[layer][e]) for e, _ in slots] == [s for _, s in slots]
    counts = asyncio.run(group.agents.call_all("op_counts", {0: None, 1: None}))
    assert counts[0] == counts[1] and counts[1]["eplb_stage"] == layers and counts[1]["eplb_swap"] == 1


def test_every_layer_staged_at_one_boundary_keeps_tokens(model_dir, group) -> None:
    """--eplb-stage-layers 0: the move's layers all stage at one boundary (one step waits for them all), the swap
    at the next: the new placement serves a step after it was planned, tokens unchanged."""
    rebalancer = group.rebalancer
    assert rebalancer is not None
    saved = rebalancer.config
    rebalancer.config = dataclasses.replace(saved, stage_layers=0)
    try:
        before = rebalancer.placement
        target = _shuffled(before)
        staged = asyncio.run(group.agents.call_all("op_counts", {0: None, 1: None}))[1]["eplb_stage"]
        prompts = _prompts(3)
        tokens, phases = _run(group, prompts, at_step=lambda n: n == 2 and rebalancer.request(target))
        assert tokens == _expected(model_dir, prompts)
        assert phases.count("during") == 1, phases
        assert rebalancer.placement == target
        counts = asyncio.run(group.agents.call_all("op_counts", {0: None, 1: None}))
        assert counts[0] == counts[1] and counts[1]["eplb_stage"] - staged == len(before.layers)
        stats = rebalancer.take_stats()
        assert stats.rebalances == 1 and len(stats.pauses_s) == 2  # the staging boundary and the swap's
    finally:
        rebalancer.config = saved


def test_the_planner_rebalances_from_the_window_and_tokens_stay_exact(model_dir, group) -> None:
    rebalancer = group.rebalancer
    assert rebalancer is not None
    rebalancer.config = dataclasses.replace(rebalancer.config, interval_s=1e-6, min_gain=0.0)
    done = len(rebalancer.history)
    prompts = _prompts(2)
    try:
        tokens, phases = _run(group, prompts)
    finally:
        rebalancer.config = dataclasses.replace(rebalancer.config, interval_s=3600.0, min_gain=0.05)
    assert tokens == _expected(model_dir, prompts)
    assert len(rebalancer.history) > done, "the window's load should have asked for a better placement"
    plan = rebalancer.history[-1]
    assert plan.after < plan.before
    stats = rebalancer.take_stats()
    assert stats.bytes_moved == sum(len(p.changes) for p in rebalancer.history[done:]) * 3 * 32 * 64 * 4


def test_int8_experts_move_with_their_quantized_weights(model_dir) -> None:
    """Load-time int8 keeps the experts' int8 weights and scales beside the float ones, and the CPU kernel reads
    the int8: a move carries them too (and the kernel's panels are rebuilt from them), so the tokens stay the
    single int8 engine's."""
    affinity = os.sched_getaffinity(0)
    g = start_group(_eplb_config(model_dir, quantization=Quantization.INT8))
    try:
        rebalancer = g.rebalancer
        assert rebalancer is not None
        experts = next(iter(g.engine.model.sparse_layers().values())).experts
        assert experts.int8 is not None  # the kernel's int8 path is what serves
        prompts = _prompts(4)
        target = _shuffled(rebalancer.placement)
        tokens, phases = _run(g, prompts, at_step=lambda n: n == 2 and rebalancer.request(target))
        assert "after" in phases and rebalancer.placement == target
        single = Engine.build(ep_config(model_dir, quantization=Quantization.INT8)).generate(prompts, GREEDY)
        assert tokens == single
        i, d = 32, 64  # float32 gate_up + down, then int8 q of both and their float32 scales per output row
        per_slot = 3 * i * d * 4 + 3 * i * d + (2 * i + d) * 4
        assert rebalancer.take_stats().bytes_moved == 2 * len(target.layers) * per_slot
    finally:
        g.close()
    assert os.sched_getaffinity(0) == affinity  # the leader (this process) unpinned: later tests see every core


@pytest.mark.slow  # a second group, killed (make test-slow)
def test_a_rank_killed_during_a_weight_move_takes_the_group_down_unplaced(model_dir) -> None:
    died = threading.Event()
    g = start_group(_eplb_config(model_dir, group_timeout_s=5.0), on_death=lambda rank, status: died.set())
    try:
        rebalancer = g.rebalancer
        assert rebalancer is not None
        before = rebalancer.placement
        weights = [m.experts.gate_up.detach().clone() for m in g.engine.model.sparse_layers().values()]
        stage = g.ops.stage_experts

        def killed_first(layer, ranks):  # the follower dies as the move starts: its collective never comes
            os.kill(g.pids[1], signal.SIGKILL)
            assert died.wait(10)
            stage(layer, ranks)

        g.ops.stage_experts = killed_first  # type: ignore[method-assign]
        g.engine.add_request("r", _prompts(3)[0], GREEDY)
        g.engine.step()
        rebalancer.request(_shuffled(before))
        g.engine.step()  # this boundary plans the move; the next stages its first layer
        assert rebalancer.moving
        with pytest.raises(RuntimeError):  # the collective fails (or the channel is gone): the engine stops
            g.engine.step()
        # what the leader serves with is still the old placement, whole: nothing was swapped in
        assert rebalancer.placement == before
        after = [m.experts.gate_up for m in g.engine.model.sparse_layers().values()]
        assert all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
        assert rebalancer.history == []
    finally:
        g.close(timeout_s=2)
