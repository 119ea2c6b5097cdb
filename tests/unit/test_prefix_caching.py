"""Prefix caching in the engine (shared/engine/prefix_caching.py): greedy tokens are the same with the cache on
and off, while requests that share a prefix with earlier ones compute only the rest — all but the last token,
an extension, a multi-turn follow-up (output blocks), a chunked rest, a prefix evicted under pressure, preemption,
forks, held KV, MLA's latent cache, a sliding window and gpt-oss's hybrid groups. Block accounting is checked
after every step; salts isolate; the router's events and snapshot follow the cache."""

from __future__ import annotations

import json
import random

import pytest

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.fork import Choice, choice_params
from shared.engine.sampling import SamplingParams
from shared.model.loader import load_model
from shared.prefix_hash import block_hashes, root_hash

B = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
Wave = list[tuple[str, list[int]]]  # (request id, prompt), added together once the previous wave is done


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


P = _tokens(37, 1)  # 9 full blocks of 4 and one token


def engine_for(checkpoint, model, caching: bool = True, **kw) -> Engine:
    base = dict(
        block_size=B,
        num_kv_blocks=64,
        max_model_len=160,
        threads=1,
        prefix_cache_namespace="demo",
        enable_prefix_caching=caching,
    )
    return Engine.build(EngineConfig(model=str(checkpoint), **(base | kw)), model=model)


def serve(engine: Engine, waves: list[Wave], params: SamplingParams = GREEDY, salts: dict[str, str] | None = None):
    """Each wave added once the previous one finished; → (tokens, num_cached_tokens) per request id. Checks the
    block accounting after every step."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for wave in waves:
        for rid, prompt in wave:
            engine.add_request(rid, prompt, params, cache_salt=(salts or {}).get(rid, ""))
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                cached.setdefault(o.request_id, o.num_cached_tokens)
            engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks  # cached blocks nobody holds count as free
    return tokens, cached


def on_and_off(checkpoint, model, waves: list[Wave], **kw):
    """Serve `waves` with the cache on and off: the tokens must agree; → (engine with the cache, its cached)."""
    off_tokens, off_cached = serve(engine_for(checkpoint, model, caching=False, **kw), waves)
    engine = engine_for(checkpoint, model, **kw)
    tokens, cached = serve(engine, waves)
    assert tokens == off_tokens
    assert set(off_cached.values()) == {0}
    return engine, tokens, cached


def test_shared_prefixes_hit_whole_blocks_and_tokens_do_not_change(checkpoint, model):
    first = [("a", P)]
    engine, tokens, cached = on_and_off(checkpoint, model, [first])
    follow_up = P + tokens["a"] + _tokens(5, 9)  # a next turn: the prompt, the answer, more
    waves = [
        first,
        [("all-but-last", P[:-1] + [3]), ("longer", P + _tokens(10, 2))],
        [("again", P), ("shorter", P[:20]), ("other", _tokens(30, 3))],
        [("turn-2", follow_up)],
    ]
    engine, _, cached = on_and_off(checkpoint, model, waves)
    assert cached == {
        "a": 0,
        "all-but-last": 36,  # 9 blocks: every token but the differing last one
        "longer": 36,
        "again": 36,  # never the whole prompt: its last token is computed to sample from
        "shorter": 16,  # 19 tokens may hit: 4 blocks
        "other": 0,
        "turn-2": 44,  # a's 37 + 7 computed output tokens: 11 blocks, its answer's included
    }
    stats = engine.prefix_cache_stats()
    assert stats.hit_tokens == sum(cached.values())
    assert stats.queried_tokens == sum(len(p) for wave in waves for _, p in wave)
    assert 0 < stats.hit_rate < 1 and stats.cached_blocks > 0 and stats.evictions == 0


def test_a_chunked_rest_after_a_hit(checkpoint, model):
    q = _tokens(100, 4)
    waves = [[("a", q)], [("b", q[:80] + _tokens(30, 5))]]
    scheduler = SchedulerConfig(max_num_batched_tokens=16)
    engine, _, cached = on_and_off(checkpoint, model, waves, scheduler=scheduler)
    assert cached["b"] == 80
    assert engine.stats.prefill_tokens == 100 + 30  # b computed only its own 30 tokens (two chunks)


def test_without_chunked_prefill_a_hit_shortens_the_whole_prompt_step(checkpoint, model):
    scheduler = SchedulerConfig(max_num_batched_tokens=160, enable_chunked_prefill=False)
    waves = [[("a", P)], [("b", P + _tokens(6, 16)), ("c", _tokens(12, 17))]]
    engine, _, cached = on_and_off(checkpoint, model, waves, scheduler=scheduler)
    assert cached == {"a": 0, "b": 36, "c": 0}
    assert engine.stats.prefill_tokens == len(P) + (len(P) + 6 - 36) + 12


def test_a_prefix_evicted_under_pressure_is_recomputed(checkpoint, model):
    # 24 blocks of 4: each 37-token request takes 11 at its end; b and c together evict a's cached blocks
    waves = [[("a", P)], [("b", _tokens(37, 6)), ("c", _tokens(37, 7))], [("a2", P)]]
    engine, _, cached = on_and_off(checkpoint, model, waves, num_kv_blocks=24, max_model_len=96)
    stats = engine.prefix_cache_stats()
    assert stats.evictions > 0
    assert cached["a2"] < 36  # its tail was evicted first (a prefix's head is what a hit needs)
    assert engine.blocks.cache is not None and engine.blocks.cache.num_evictable > 0


def test_preempted_requests_hit_their_own_blocks_when_readmitted(checkpoint, model):
    prompts = [("a", _tokens(20, 10)), ("b", _tokens(20, 11)), ("c", _tokens(20, 12))]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw = dict(num_kv_blocks=30, max_model_len=64)
    off = engine_for(checkpoint, model, caching=False, **kw)
    on = engine_for(checkpoint, model, **kw)
    off_tokens, _ = serve(off, [prompts], params)
    on_tokens, _ = serve(on, [prompts], params)
    assert on_tokens == off_tokens
    assert on.stats.preemptions > 0 and off.stats.preemptions > 0
    assert on.stats.prefill_tokens < off.stats.prefill_tokens  # a readmitted victim skipped its cached blocks


def test_blocks_shared_by_requests_are_freed_only_when_the_last_one_ends(checkpoint, model):
    engine = engine_for(checkpoint, model)
    engine.add_request("long", P, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while engine.requests["long"].num_computed_tokens < len(P):
        engine.step()
    engine.add_request("short", P[:-1] + [4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    short = engine.requests["short"]
    assert short.num_cached_tokens == 36
    shared = engine.requests["long"].block_table[:9]
    assert short.block_table[:9] == shared and all(engine.blocks.ref_count(b) == 2 for b in shared)
    while "short" in engine.requests:
        engine.step()
        engine.check_integrity()
    assert all(engine.blocks.ref_count(b) == 1 for b in shared)  # still the long one's
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    cache = engine.blocks.cache
    assert cache is not None and all(engine.blocks.ref_count(b) == 0 and cache.is_evictable(b) for b in shared)


def test_salts_never_share_blocks(checkpoint, model):
    engine = engine_for(checkpoint, model)
    salts = {"x1": "tenant-x", "y": "tenant-y", "x2": "tenant-x"}
    _, cached = serve(engine, [[("x1", P)], [("y", P), ("none", P)], [("x2", P)]], salts=salts)
    assert cached == {"x1": 0, "y": 0, "none": 0, "x2": 36}


def test_events_and_the_snapshot_follow_the_cache(checkpoint, model):
    engine = engine_for(checkpoint, model, num_kv_blocks=24, max_model_len=96)
    assert engine.prefix_cache_events().stored == []
    tokens, _ = serve(engine, [[("a", P)]], salts={"a": "s"})
    computed = P + tokens["a"][:-1]  # the last sampled token never went through the model
    expected = block_hashes(computed, B, root_hash("demo", "s"))
    events = engine.prefix_cache_events()
    assert events.stored == expected and events.removed == [] and not events.overflowed
    assert sorted(engine.prefix_cache_hashes()) == sorted(expected)
    assert engine.prefix_cache_events().stored == []  # taken
    serve(engine, [[("b", _tokens(37, 6)), ("c", _tokens(37, 7))]])  # evicts some of a's
    events = engine.prefix_cache_events()
    assert events.removed and set(events.removed) <= set(expected)
    assert set(engine.prefix_cache_hashes()) == (set(expected) - set(events.removed)) | set(events.stored)


def test_with_caching_off_nothing_is_cached_or_reported(checkpoint, model):
    engine = engine_for(checkpoint, model, caching=False)
    serve(engine, [[("a", P)], [("b", P)]])
    assert engine.blocks.cache is None and engine.scheduler.prefix is None
    events = engine.prefix_cache_events()
    assert (events.stored, events.removed, events.overflowed) == ([], [], False)
    assert engine.prefix_cache_hashes() == [] and engine.prefix_cache_stats().hit_rate == 0.0


def test_prompt_logprobs_are_computed_not_taken_from_the_cache(checkpoint, model):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    off = engine_for(checkpoint, model, caching=False)
    on = engine_for(checkpoint, model)
    serve(on, [[("warm", P)]])
    results = []
    for engine in (off, on):
        engine.add_request("scored", P, params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        results.append(outs)
    assert results[1][0].num_cached_tokens == 0
    assert results[1][0].prompt_logprobs == results[0][0].prompt_logprobs


def test_forked_choices_over_a_cached_prompt(checkpoint, model):
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    got = []
    for caching in (False, True):
        engine = engine_for(checkpoint, model, caching=caching)
        serve(engine, [[("warm", P)]])
        engine.add_group(P, [Choice(f"g/{i}", choice_params(sampled, i)) for i in range(3)])
        tokens: dict[str, list[int]] = {}
        cached = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                cached.setdefault(o.request_id, o.num_cached_tokens)
            engine.check_integrity()
        assert engine.blocks.num_free == engine.blocks.num_blocks
        got.append((tokens, cached))
    assert got[0][0] == got[1][0]
    assert got[1][1] == {"g/0": 36, "g/1": 36, "g/2": 36}


def test_held_blocks_are_never_evicted(checkpoint, model):
    engine = engine_for(checkpoint, model, num_kv_blocks=24, max_model_len=96)
    engine.add_request("held", P, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    before = engine.export_kv("held").blocks.clone()
    held = list(engine.requests["held"].block_table)
    serve_pressure = [[("b", _tokens(37, 6))], [("c", _tokens(37, 7))], [("d", _tokens(37, 8))]]
    for wave in serve_pressure:  # each fills what the held request leaves; cached blocks are evicted meanwhile
        for rid, prompt in wave:
            engine.add_request(rid, prompt, GREEDY)
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
    cache = engine.blocks.cache
    assert cache is not None and cache.evictions > 0
    assert all(engine.blocks.ref_count(b) == 1 for b in held)
    assert engine.export_kv("held").blocks.equal(before)
    engine.release_kv("held")
    engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks


# ---- other KV layouts -----------------------------------------------------------------------------------


def _layout_waves() -> list[Wave]:
    q = _tokens(100, 13)
    return [[("a", q)], [("b", q[:90] + _tokens(20, 14)), ("c", q[:-1] + [6])], [("d", q + _tokens(9, 15))]]


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral-window", "gpt_oss"])
def test_other_kv_layouts_hit_and_keep_their_tokens(tmp_path_factory, arch):
    """MLA's latent cache (one plane), a model whose every layer slides (one group, blocks freed behind the
    window), and gpt-oss's full + sliding groups."""
    name = arch.removesuffix("-window")
    path = write_demo_checkpoint(tmp_path_factory.mktemp(arch), arch=name, size="tiny")
    if arch.endswith("-window"):
        config = json.loads((path / "config.json").read_text()) | {"sliding_window": 16}
        (path / "config.json").write_text(json.dumps(config))
    model = load_model(path)
    engine, _, cached = on_and_off(
        path, model, _layout_waves(), max_model_len=256, scheduler=SchedulerConfig(max_num_batched_tokens=32)
    )
    if arch != "deepseek_v3":
        assert engine.scheduler.freed_behind_window > 0  # the window's blocks were freed (and stayed cached)
    assert cached["b"] == 88 and cached["c"] == 96 and cached["d"] >= 96
    for blocks in engine.group_blocks:
        blocks.check_integrity()


def test_a_worker_exports_the_prefix_cache_metrics_and_names_blocks_by_its_served_model(checkpoint, model):
    from prometheus_client import REGISTRY

    from services.mixed.worker import MixedWorker
    from shared.settings import WorkerSettings
    from shared.worker.engine_factory import build_engine
    from shared.worker.engine_load import EngineLoad

    config = EngineConfig(str(checkpoint), block_size=B, num_kv_blocks=64, max_model_len=160, threads=1)
    settings = WorkerSettings(engine=config, worker_id="prefix", metrics_port=None, model_name="served-name")
    engine, _ = build_engine(settings)
    assert engine.config.prefix_cache_namespace == "served-name"
    worker = MixedWorker(settings, engine=engine)
    labels = {"model_name": worker.model_name, "role": str(worker.role)}

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(f"pdserve:{name}", labels)

    base = {n: sample(n) or 0.0 for n in ("prefix_cache_queries_total", "prefix_cache_hits_total")}
    tokens, _ = serve(engine, [[("a", P)], [("b", P)]])
    worker.load = EngineLoad.of(engine)
    worker.heartbeat()
    assert sample("prefix_cache_queries_total") - base["prefix_cache_queries_total"] == 2 * len(P)
    assert sample("prefix_cache_hits_total") - base["prefix_cache_hits_total"] == 36
    assert sample("prefix_cache_hit_rate") == pytest.approx(36 / (2 * len(P)))
    assert sample("prefix_cache_blocks") == len(engine.prefix_cache_hashes()) > 0
    worker.heartbeat()  # the same totals again: counted once
    assert sample("prefix_cache_hits_total") - base["prefix_cache_hits_total"] == 36
    expected = block_hashes(P + tokens["a"][:-1], B, root_hash("served-name"))
    assert set(expected) <= set(engine.prefix_cache_hashes())  # what the gateway computes for that model name


def test_a_continued_request_hits_its_prompt_and_the_output_it_carries(checkpoint, model):
    """A request moved with its tokens so far (output_token_ids) recomputes prompt + output: cached blocks of
    both are taken, and it samples on as without the cache."""
    got = []
    for caching in (False, True):
        engine = engine_for(checkpoint, model, caching=caching)
        tokens, _ = serve(engine, [[("a", P)]])
        engine.add_request("moved", P, GREEDY, output_token_ids=tokens["a"][:5])
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
            engine.check_integrity()
        got.append(([t for o in outs for t in o.new_token_ids], outs[0].num_cached_tokens, engine.stats.prefill_tokens))
    (off_tokens, off_cached, off_computed), (on_tokens, on_cached, on_computed) = got
    assert on_tokens == off_tokens and off_cached == 0
    assert on_cached == len(P)  # every prompt token came from the cache
    assert off_computed - on_computed == 40  # 10 blocks of prompt + carried output were not recomputed
