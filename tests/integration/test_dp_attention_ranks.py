"""Data-parallel attention with expert-parallel MoE (--dp-attention) over the tiny DeepSeek-V3 demo (MLA, a dense
first layer, then MoE with a shared expert), gloo, float32 greedy: token-exact against one engine.

- SPMD (run_on_ranks): every rank builds its engine and runs the same requests; each rank runs attention over its
  own requests only (counted per rank: every token once, on one rank), uneven batches included, and a rank
  without any request, which still joins every MoE layer's exchange; every rank's expert counters are the
  group's (one engine's counts). At 2 ranks in `make test`, at 4 in the
  slow tier.
- A real worker group of 2 (start_group, the leader's op stream; slow tier): chunked prefills under KV pressure
  (preemptions), n choices forked on their parent's rank, imports (sent by the leader; staged), each written into its
  request's rank's pool only; the ranks' pools differ (each holds its own requests' KV). A group of 4 (slow tier):
  3 requests (one rank idle), then 6 (uneven), every rank's pool its own. With --eplb: a re-placement forced
  mid-generation keeps the tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from services.demo_model import write_demo_checkpoint
from shared.engine import dp_step
from shared.engine.config import EplbConfig
from shared.engine.engine import Engine
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport
from shared.engine.sampling import SamplingParams
from shared.parallel.group_engine import WorkerGroup, start_group
from shared.parallel.launch import run_on_ranks
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement
from shared.worker.heartbeat import beat_facts
from tests.ep_groups import ep_config, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
UNEVEN, ONE = (29, 7, 40), (13,)  # 3 requests on 2 ranks (2 + 1); one request: the other rank has none


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("dsv3") / "demo", arch="deepseek_v3")


def _generate(group: RankGroup, model_dir: str, workloads: list[tuple[int, ...]]) -> list[dict]:
    """Rank `group.rank`: each workload's tokens, and the tokens this rank ran attention for."""
    own = [0]
    cut = dp_step.DpSlice.of

    def counted(inputs, rank, world):
        part = cut(inputs, rank, world)
        own[0] += len(part.inputs.input_ids)
        return part

    dp_step.DpSlice.of = counted  # this rank's process only (spawned, or the test's own rank 0)
    try:
        results = []
        for lengths in workloads:
            engine = Engine.build(ep_config(model_dir, ep=group.world, dp_attention=True), group=group)
            own[0] = 0
            tokens = engine.generate(random_prompts(1, lengths), GREEDY)
            integrity, load, rank_load = beat_facts(engine)
            assert integrity is None and rank_load is not None
            computed = engine.stats.prefill_tokens + engine.stats.decode_tokens
            results.append({"tokens": tokens, "own": own[0], "computed": computed, "load": load,
                            "rank_load": rank_load.per_rank})  # fmt: skip
        return results
    finally:
        dp_step.DpSlice.of = cut


def _check_against_one_engine(model_dir, ranks: list[list[dict]], workloads) -> None:
    for w, lengths in enumerate(workloads):
        single = Engine.build(ep_config(model_dir))
        want = single.generate(random_prompts(1, lengths), GREEDY)
        _, want_load, _ = beat_facts(single)
        got = [r[w] for r in ranks]
        assert all(g["tokens"] == want for g in got), lengths
        # the counts exchange gives every rank the group's expert counters, as one engine counts them
        assert all(g["load"] == want_load for g in got), lengths
        pairs = sum(sum(c) for c in want_load.values())
        assert all(g["rank_load"] == got[0]["rank_load"] and sum(g["rank_load"]) == pairs for g in got)
        owns = [g["own"] for g in got]
        # every token through attention once, on one rank; a rank per request while there are more ranks
        assert sum(owns) == got[0]["computed"], owns
        busy = sum(o > 0 for o in owns)
        assert busy == min(len(lengths), len(owns)), owns


def test_dp_attention_at_2_ranks_is_token_exact_with_uneven_batches_and_an_idle_rank(model_dir) -> None:
    workloads = [UNEVEN, ONE]
    _check_against_one_engine(model_dir, run_on_ranks(2, _generate, (str(model_dir), workloads)), workloads)


@pytest.mark.slow  # four spawned ranks on 2 cores: ~25 s
def test_dp_attention_at_4_ranks_is_token_exact_with_uneven_batches_and_an_idle_rank(model_dir) -> None:
    workloads = [(29, 7, 40, 13, 1, 22), (29, 7, 40)]  # 2 + 2 + 1 + 1; then 3 requests: one rank idle
    ranks = run_on_ranks(4, _generate, (str(model_dir), workloads), timeout_s=240)
    _check_against_one_engine(model_dir, ranks, workloads)


def _workload(engine: Engine, imported: tuple[list[int], list[int], KVExport], staged_ref) -> dict[str, list[int]]:
    """Chunked prefills with KV pressure (preemptions), 3 choices of one prompt, and two imports."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(random_prompts(3, (27, 9, 33, 18))):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    engine.add_group(random_prompts(3, (9,))[0], [Choice(f"c{i}", seeded) for i in range(3)])
    prompt, first, kv = imported
    engine.import_kv("imp-staged", prompt, first, GREEDY, staged_ref(kv))
    engine.import_kv("imp", prompt, first, GREEDY, kv)
    out["blocks"] = engine.requests["imp-staged"].block_table[:1] + engine.requests["imp"].block_table[:1]
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _exported(model_dir) -> tuple[list[int], list[int], KVExport]:
    """A prompt's KV and first token from one engine (what a prefill worker hands on)."""
    engine = Engine.build(ep_config(model_dir))
    prompt = random_prompts(5, (21,))[0]
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            first += o.new_token_ids
    return prompt, first, engine.export_kv("p")


@pytest.fixture(scope="module")
def group(model_dir):
    deaths: list[tuple[int, int | None]] = []
    config = ep_config(model_dir, ep=2, dp_attention=True, num_kv_blocks=14, max_model_len=56)
    g = start_group(config, on_death=lambda rank, status: deaths.append((rank, status)))
    yield g
    g.close()
    assert not deaths, f"a follower died during the tests: {deaths}"


@pytest.mark.slow  # a worker group: ranks spawned (make test-slow)
def test_a_dp_attention_group_matches_one_engine_and_each_rank_holds_its_own_kv(model_dir, group: WorkerGroup):
    imported = _exported(model_dir)
    key = "staged-imp"

    def staged(kv: KVExport):  # each rank stages its copy (a pull); the request's rank writes it, the other drops it
        asyncio.run(group.agents.call_all("stage_kv", {r: (key, kv) for r in group.agents.ranks}))
        return group.ops.state.staged.ref(key)

    single = Engine.build(ep_config(model_dir, num_kv_blocks=28, max_model_len=56))  # the group's 2 x 14 blocks
    expected = _workload(single, imported, staged_ref=lambda kv: kv)
    got = _workload(group.engine, imported, staged_ref=staged)
    # the imports' ranks: the staged one on rank 0 (no request yet), the broadcast one on rank 1, the least loaded
    # then (its KV sent to rank 1 alone)
    assert [b % 2 for b in got.pop("blocks")] == [0, 1]
    expected.pop("blocks")
    assert got == expected
    assert got["imp-staged"] == got["imp"]
    assert group.engine.stats.preemptions > 0, "the workload is meant to preempt"
    group.engine.check_integrity()
    group.ops.sync()
    digests = asyncio.run(group.agents.call_all("pool_digest", {0: None, 1: None}))
    assert digests[0] != digests[1], "each rank's pool holds its own requests' KV"
    counts = asyncio.run(group.agents.call_all("op_counts", {0: None, 1: None}))
    assert counts[0] == counts[1] and counts[1]["step"] == group.engine.stats.steps
    assert counts[1]["copy"] >= 1 and counts[1]["write"] == 1 and counts[1]["import_staged"] == 1
    staged_left = asyncio.run(group.agents.call_all("unstage_kv", {0: key, 1: key}))
    assert staged_left == {0: False, 1: False}, "the idle rank dropped its staged copy"


@pytest.mark.slow  # a worker group of four spawned ranks on 2 cores
def test_a_dp_attention_group_of_4_matches_one_engine_with_an_idle_rank_then_uneven_batches(model_dir) -> None:
    deaths: list[tuple[int, int | None]] = []
    config = ep_config(model_dir, ep=4, dp_attention=True)
    group = start_group(config, on_death=lambda rank, status: deaths.append((rank, status)))
    try:
        for lengths in ((29, 7, 40), (29, 7, 40, 13, 1, 22)):  # 3 requests on 4 ranks; then 2 + 2 + 1 + 1
            want = Engine.build(ep_config(model_dir)).generate(random_prompts(1, lengths), GREEDY)
            assert group.engine.generate(random_prompts(1, lengths), GREEDY) == want, lengths
        group.engine.check_integrity()
        group.ops.sync()
        digests = asyncio.run(group.agents.call_all("pool_digest", dict.fromkeys(range(4))))
        assert len(set(digests.values())) == 4, "each rank's pool holds its own requests' KV"
    finally:
        group.close()
    assert not deaths, f"a follower died: {deaths}"


@pytest.mark.slow  # a worker group: ranks spawned (make test-slow)
def test_a_forced_expert_re_placement_mid_generation_keeps_a_dp_group_token_exact(model_dir) -> None:
    """--eplb under data-parallel attention: the leader's window holds the group's expert counts (the counts
    exchange), and a re-placement forced mid-generation (the ranks trade one expert per layer) keeps the tokens."""
    deaths: list[tuple[int, int | None]] = []
    eplb = EplbConfig(enabled=True, window_steps=8, interval_s=3600.0, redundant=2, min_gain=0.05)
    config = ep_config(model_dir, ep=2, dp_attention=True, eplb=eplb)
    group = start_group(config, on_death=lambda rank, status: deaths.append((rank, status)))
    try:
        rebalancer = group.rebalancer
        assert rebalancer is not None
        before = rebalancer.placement
        layers = {}
        for layer, (zero, one) in before.layers.items():  # one expert each that the other rank lacks, traded
            give, take = next(e for e in zero if e not in one), next(e for e in one if e not in zero)
            layers[layer] = [[take if e == give else e for e in zero], [give if e == take else e for e in one]]
        target = ExpertPlacement(before.ep, before.num_experts, layers)
        prompts = random_prompts(2, (29, 7, 40))
        engine, out = group.engine, {f"r{i}": [] for i in range(len(prompts))}
        for rid, p in zip(out, prompts, strict=True):
            engine.add_request(rid, p, GREEDY)
        step = 0
        while engine.has_unfinished():
            if step == 2:
                rebalancer.request(target)
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            step += 1
        assert list(out.values()) == Engine.build(ep_config(model_dir)).generate(prompts, GREEDY)
        assert rebalancer.placement == target and len(rebalancer.history) == 1
        group.ops.sync()
        held = asyncio.run(group.agents.call_all("expert_slots", {0: None, 1: None}))
        for rank, rank_layers in held.items():
            for layer, slots in rank_layers.items():
                assert [e for e, _ in slots] == target.layers[layer][rank]
    finally:
        group.close()
    assert not deaths, f"a follower died: {deaths}"
