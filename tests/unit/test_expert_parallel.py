"""Expert parallelism over spawned gloo ranks (shared/parallel/launch.py) against the single-rank model: the
MoE layer's routed sum with both combines (ragged T including 0 and 1, top-k 1..4, an expert nobody routes
to, the default placement and one with replicas), and token-exact greedy generation at EP = 2 for every MoE
architecture (SPMD: every rank builds an Engine over its shard and runs the same requests; the scheduler is
deterministic, so the ranks' steps line up)."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.group_model import load_rank_model
from shared.engine.sampling import SamplingParams
from shared.model.config import ARCHITECTURES
from shared.model.loader import load_model
from shared.parallel.launch import local_rendezvous, spawn_followers
from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup
from shared.sharding.layout import ParallelLayout
from shared.sharding.placement import ExpertPlacement, PlacementError
from shared.worker.heartbeat import beat_facts

MOE_ARCHS = sorted(a for a, spec in ARCHITECTURES.items() if spec.moe)
EP = 2
TOKENS = (0, 1, 2, 5, 37)
# 8 experts, 2 redundant: expert 0 on both ranks, expert 5 on both ranks
REPLICATED = {"ep": 2, "num_experts": 8, "layers": {"0": [[0, 1, 2, 5, 6], [5, 0, 3, 4, 7]]}}


def _spmd(target, *args):
    """Run target(group, *args) on EP ranks; → the leader's result and the followers'."""
    rdv = local_rendezvous(EP, timeout_s=60)
    queue = mp.get_context("spawn").Queue()
    procs = spawn_followers(rdv, _follower, (target, queue, *args))
    leader = target(RankGroup.join(rdv, 0), *args)
    followers = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(10)
    return leader, followers


def _follower(group, target, queue, *args):
    try:
        queue.put(target(group, *args))
    except Exception as exc:  # the leader's assertion names it
        queue.put(repr(exc))
        raise


def _routing(num_experts: int, t: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token that never name expert 3, and normalised weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e != 3])
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    w = torch.rand(t, top_k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def _layer_errors(group: RankGroup, ckpt: str) -> list[str]:
    """Every case's routed sum on this rank against the full single-rank layer; → the failures."""
    torch.manual_seed(0)
    full = next(iter(load_model(ckpt).sparse_layers().values()))
    placements = {"default": None, "replicated": ExpertPlacement.from_json(REPLICATED)}
    errors = []
    for pname, placement in placements.items():
        for mode in EPDispatch:
            model = load_model(
                ckpt, group=group, layout=ParallelLayout(ep=EP), expert_placement=placement, ep_dispatch=mode
            )
            moe = model.sparse_layers()[0]
            assert moe.dispatch is not None
            for t in TOKENS:
                for top_k in (1, 2, 3, 4):
                    x = torch.randn(t, full.gate.in_features, generator=torch.Generator().manual_seed(t * 10 + top_k))
                    ids, w = _routing(full.experts.total_experts, t, top_k, seed=t + top_k)
                    with torch.no_grad():
                        want = full.experts.forward_reference(x, ids, w)
                        got = moe.dispatch.forward(moe.experts, x, ids, w)
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                        errors.append(f"{pname} {mode} T={t} top_k={top_k}: differs")
            with torch.no_grad():  # the whole block (router, shared expert) as the model runs it
                x = torch.randn(13, full.gate.in_features, generator=torch.Generator().manual_seed(7))
                if not torch.allclose(moe(x), full(x), rtol=1e-5, atol=1e-5):
                    errors.append(f"{pname} {mode}: MoE.forward differs")
    return errors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: str(write_demo_checkpoint(tmp_path_factory.mktemp(arch), arch=arch)) for arch in MOE_ARCHS}


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_moe_layer_at_ep2_equals_the_single_rank_layer(checkpoints):
    leader, followers = _spmd(_layer_errors, checkpoints["qwen2_moe"])  # qwen2_moe: with its shared expert
    assert leader == [] and followers == [[]]


PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8], list(range(10, 60)), [42]]


def _generate(group: RankGroup | None, ckpt: str, mode: str, placement: str | None = None) -> dict:
    config = EngineConfig(
        model=ckpt,
        num_kv_blocks=64,
        max_model_len=256,
        ep=group.world if group else 1,
        ep_dispatch=EPDispatch(mode),
        expert_placement=placement,
    )
    engine = Engine.build(config, group=group)  # loads this rank's shard (load_rank_model)
    engine.model.take_expert_load()
    tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    integrity, load, rank_load = beat_facts(engine)  # what the worker's heartbeat path reads
    assert integrity is None
    return {"tokens": tokens, "load": load, "rank_load": rank_load and rank_load.per_rank}


def _generate_all(group: RankGroup, checkpoints: dict, placement: str) -> dict:
    runs: dict[tuple[str, str, str | None], tuple[str, str, str | None]] = {
        (arch, str(mode), None): (ckpt, str(mode), None) for arch, ckpt in checkpoints.items() for mode in EPDispatch
    }
    # with replicas (expert 0 and 5 on both ranks), through the configuration's placement file
    runs[("qwen3_moe", "alltoall", "replicated")] = (checkpoints["qwen3_moe"], "alltoall", placement)
    runs[("qwen3_moe", "allreduce", "replicated")] = (checkpoints["qwen3_moe"], "allreduce", placement)
    return {key: _generate(group, *args) for key, args in runs.items()}


# Spawned gloo ranks generating for every MoE architecture: over a minute on two cores, a worker-group scenario
# of the slow tier (make test-slow); the single-layer EP 2 checks here stay in make test.
@pytest.mark.slow
def test_greedy_generation_at_ep2_is_token_exact_for_every_moe_architecture(checkpoints, tmp_path):
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(REPLICATED))
    leader, followers = _spmd(_generate_all, checkpoints, str(placement))
    assert len(leader) == 2 * len(MOE_ARCHS) + 2
    for (arch, _mode, _placement), got in leader.items():
        want = _generate(None, checkpoints[arch], EPDispatch.ALLTOALL)
        assert got["tokens"] == want["tokens"], arch
        # the router is replicated: every rank's per-expert counters are the group's, equal to one rank's
        assert got["load"] == want["load"], arch
        pairs = sum(sum(c) for c in want["load"].values())
        assert sum(got["rank_load"]) == pairs and min(got["rank_load"]) > 0, arch
    assert followers == [leader]


def test_a_placement_that_does_not_match_the_model_is_refused(checkpoints, tmp_path):
    model_dir = checkpoints["qwen3_moe"]
    group = RankGroup(0, EP, None)  # never runs a collective: the refusal comes first
    layout = ParallelLayout(ep=EP)
    wrong_layers = ExpertPlacement.from_json({**REPLICATED, "layers": {"5": REPLICATED["layers"]["0"]}})
    with pytest.raises(PlacementError, match="covers layers"):
        load_model(model_dir, group=group, layout=layout, expert_placement=wrong_layers)
    wrong_ep = ExpertPlacement.from_json({"ep": 4, "num_experts": 8, "layers": {"0": [[0, 1], [2, 3], [4, 5], [6, 7]]}})
    with pytest.raises(PlacementError, match="ep=4"):
        load_model(model_dir, group=group, layout=layout, expert_placement=wrong_ep)
    wrong_e = ExpertPlacement.from_json({"ep": 2, "num_experts": 4, "layers": {"0": [[0, 1], [2, 3]]}})
    with pytest.raises(PlacementError, match="4 experts"):
        load_model(model_dir, group=group, layout=layout, expert_placement=wrong_e)
    # the same refusal through the engine configuration's --expert-placement file
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(wrong_e.to_json()))
    with pytest.raises(PlacementError, match="the model has 8"):
        load_rank_model(EngineConfig(model=model_dir, ep=EP, expert_placement=str(path)), group)
    with pytest.raises(ValueError, match="needs a group of 2 ranks"):  # an engine at ep=2 alone
        Engine.build(EngineConfig(model=model_dir, ep=EP))


def test_a_rank_loads_only_its_experts_and_reads_no_other(checkpoints, monkeypatch, caplog):
    from safetensors import safe_open

    read: list[str] = []
    real = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):  # metadata (dtype, shape) is free; indexing the slice reads the data
            inner = self.f.get_slice(name)

            class Slice:
                def get_dtype(self):
                    return inner.get_dtype()

                def get_shape(self):
                    return inner.get_shape()

                def __getitem__(self, index):
                    read.append(name)
                    return inner[index]

            return Slice()

    monkeypatch.setattr("shared.model.loader.safe_open", Spy)
    placement = ExpertPlacement.from_json(REPLICATED)
    model = load_model(
        checkpoints["qwen3_moe"], group=RankGroup(1, EP, None), layout=ParallelLayout(ep=EP), expert_placement=placement
    )
    experts = model.sparse_layers()[0].experts
    assert experts.slots == [5, 0, 3, 4, 7] and experts.gate_up.shape[0] == 5
    held = {f".experts.{e}." for e in experts.slots}
    expert_reads = [n for n in read if ".mlp.experts." in n and ".layers.0." in n]
    assert expert_reads and all(any(h in n for h in held) for n in expert_reads)
    assert "unexpected checkpoint tensor" not in caplog.text
    full = load_model(checkpoints["qwen3_moe"]).sparse_layers()[0].experts
    assert torch.equal(experts.gate_up[1], full.gate_up[0]) and torch.equal(experts.down[0], full.down[5])
