"""Overlap scheduling (shared/engine/overlap.py) gives the tokens lockstep stepping gives: each test drives two
engines over the same tiny random-weight checkpoint, overlap off and on, through the same requests and the same
calls between steps, and compares every request's tokens and finish reason; and it checks that the overlapped
engine did launch steps ahead of their tokens (`overlapped_steps`), so that no comparison passes for want of
overlap."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from benchmarks import overlap_bench
from shared.config_fields import from_env
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine, RequestOutput
from shared.engine.fork import Choice, choice_params
from shared.engine.request import FinishReason
from shared.engine.sampling import SamplingParams
from shared.engine.step_clock import StepClock
from shared.settings import WorkerSettings
from shared.structured import spec as specs

BLOCK = 4
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def make_engine(checkpoint, model, overlap: bool, blocks: int = 96, caching: bool = False, budget: int = 32) -> Engine:
    config = EngineConfig(
        model=str(checkpoint),
        overlap_scheduling=overlap,
        block_size=BLOCK,
        num_kv_blocks=blocks,
        max_model_len=min(128, blocks * BLOCK),
        enable_prefix_caching=caching,
        seed=11,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
    )
    return Engine.build(config, model=model)


@dataclass
class Served:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason | None] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens found in the prefix cache
    counted: dict[str, int] = field(default_factory=dict)  # output tokens the last output counts (usage)
    computed: dict[str, int] = field(default_factory=dict)  # a held request's tokens in its KV


OnStep = Callable[[Engine, int, list[RequestOutput]], None]  # (engine, step index, its outputs)


def serve(engine: Engine, on_step: OnStep | None = None) -> Served:
    """Step to the end, checking the blocks after every step; `on_step` may add or abort requests."""
    served, i = Served(), 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            served.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            served.cached[o.request_id] = o.num_cached_tokens
            served.counted[o.request_id] = o.num_output_tokens
            if o.finished:
                served.reasons[o.request_id] = o.finish_reason
        engine.check_integrity()
        if on_step is not None:
            on_step(engine, i, outs)
        i += 1
    return served


def both(checkpoint, model, drive: Callable[[Engine], Served], **kw) -> tuple[Served, Served, Engine]:
    """`drive` on a lockstep engine and on an overlapped one; the overlapped engine comes back for its stats."""
    lockstep = drive(make_engine(checkpoint, model, overlap=False, **kw))
    engine = make_engine(checkpoint, model, overlap=True, **kw)
    overlapped = drive(engine)
    assert engine.stats.overlapped_steps > 0
    return lockstep, overlapped, engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_the_switch_is_a_worker_setting_and_off_by_default():
    assert from_env(WorkerSettings, {}).engine.overlap_scheduling is False
    assert from_env(WorkerSettings, {"PDSERVE_OVERLAP_SCHEDULING": "1"}).engine.overlap_scheduling is True


STOP = tuple(range(100, 140))  # ~15% of the vocabulary: some requests stop early, at varying steps
MIXED = [
    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # its last token known before it is sampled
    SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop_token_ids=STOP),
    SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=STOP),
    SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, stop_token_ids=STOP),  # draws from the engine's random stream
]


def add_mixed(engine: Engine, n: int, variants: int, hold_kv: bool = False) -> None:
    for i, p in enumerate(prompts(n)):
        engine.add_request(f"r{i}", p, MIXED[i % variants], hold_kv=hold_kv)


def test_stops_and_lengths_give_the_same_tokens(checkpoint, model):
    """Greedy, seeded and unseeded rows ending by length (max_tokens 1 included) and by stop tokens, found one step
    late: the row launched for a request that stopped is wasted and draws nothing from the engine's random stream,
    so even unseeded rows agree when the batches do. Every request holds its KV: what it holds (and the tokens
    its outputs count) must be what lockstep leaves, not what the wasted row added."""

    def drive(engine: Engine) -> Served:
        add_mixed(engine, 10, variants=5, hold_kv=True)
        served = serve(engine)
        for rid in served.tokens:
            served.computed[rid] = engine.kv_blocks(rid)[0]
            assert engine.release_kv(rid)
        return served

    lockstep, overlapped, engine = both(checkpoint, model, drive)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert overlapped.counted == lockstep.counted and overlapped.computed == lockstep.computed
    assert set(lockstep.reasons.values()) == {FinishReason.STOP, FinishReason.LENGTH}  # both endings exercised
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_preemption_gives_the_same_greedy_and_seeded_tokens(checkpoint, model):
    """A pool small enough to preempt, chunked prompts. Unseeded rows are left out: a request that stopped holds
    its blocks until the step after, so preemptions (hence batches, hence the draws' order) may differ."""

    def drive(engine: Engine) -> Served:
        add_mixed(engine, 10, variants=4)
        return serve(engine)

    lockstep, overlapped, engine = both(checkpoint, model, drive, blocks=24)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert engine.stats.preemptions > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_aborts_between_steps_give_the_same_tokens(checkpoint, model):
    """Aborts as the gateway sends them (a stop string matched, a client gone): after a request's 3rd token, after
    another's 1st, and of one still queued; the overlapped engine has their next step in flight then."""

    def drive(engine: Engine) -> Served:
        for i, p in enumerate(prompts(9, seed=1)):
            engine.add_request(f"r{i}", p, GREEDY)
        counts: dict[str, int] = {}

        def on_step(engine: Engine, step: int, outs: list[RequestOutput]) -> None:
            for o in outs:
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
            for rid, after in (("r0", 3), ("r4", 1)):
                if counts.get(rid) == after and engine.abort(rid):
                    counts[rid] += 100  # aborted once
            if step == 1:
                assert engine.abort("r8")  # admitted later (8 sequence slots): still queued

        return serve(engine, on_step)

    lockstep, overlapped, engine = both(checkpoint, model, drive)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert len(lockstep.tokens["r0"]) == 3 and len(lockstep.tokens["r4"]) == 1 and "r8" not in lockstep.tokens
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_grammar_and_penalty_requests_step_in_lockstep_and_change_nothing(checkpoint, model, tokenizer):
    """A request with a grammar, and one with penalties, arrive while plain ones run overlapped: the engine takes
    the step in flight and steps in lockstep while they live, then overlaps again."""
    pattern = r"[a-c]{2,5}-[0-9]{1,3}"

    def drive(engine: Engine) -> Served:
        for i, p in enumerate(prompts(4, seed=2)):
            engine.add_request(f"plain{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))

        def on_step(engine: Engine, step: int, outs: list[RequestOutput]) -> None:
            if step == 3:
                grammar = SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured=specs.regex(pattern))
                engine.add_request("grammar", [5, 6, 7, 8, 9], grammar)
                penalties = SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3)
                engine.add_request("penalties", [9, 8, 7], penalties)

        return serve(engine, on_step)

    lockstep, overlapped, engine = both(checkpoint, model, drive)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert 0 < engine.stats.overlapped_steps < engine.stats.steps  # some steps in lockstep, some overlapped
    assert overlapped.reasons["grammar"] is FinishReason.STOP  # the grammar completed, and held:
    assert re.fullmatch(pattern, tokenizer.decode(overlapped.tokens["grammar"][:-1]))


def test_choices_and_prefix_cache_hits_give_the_same_tokens(checkpoint, model):
    """n = 3 choices of one prompt (forked at the parent's first token, in lockstep), beside plain requests; then
    a second wave that finds the first wave's prompts in the prefix cache."""
    shared_prefix = list(range(20, 44))  # six whole blocks
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True)

    def drive(engine: Engine) -> Served:
        engine.add_group(shared_prefix + [7, 8], [Choice(f"g/{i}", choice_params(sampled, i)) for i in range(3)])
        for i, p in enumerate(prompts(3, seed=3)):
            engine.add_request(f"a{i}", shared_prefix + p, GREEDY)
        first = serve(engine)
        for i, p in enumerate(prompts(3, seed=4)):
            engine.add_request(f"b{i}", shared_prefix + p, GREEDY)
        second = serve(engine)
        return Served({**first.tokens, **second.tokens}, {**first.reasons, **second.reasons}, second.cached)

    lockstep, overlapped, _ = both(checkpoint, model, drive, caching=True)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert len({tuple(overlapped.tokens[f"g/{i}"]) for i in range(3)}) > 1  # the choices did part
    assert all(overlapped.cached[f"b{i}"] >= len(shared_prefix) for i in range(3))


@pytest.mark.parametrize("prefill_overlaps", [False, True])
def test_a_prefill_workers_held_kv_continues_the_same_on_a_decode_engine(checkpoint, model, prefill_overlaps):
    """The disaggregated path: a prefill engine holds each request's KV after its one token (max_tokens 1: known
    to be its last before it is sampled), exports and releases it; a decode engine imports it and decodes on. The
    decode engine overlapped or not, and the prefill engine as parametrized, the tokens are the same."""
    prefill = make_engine(checkpoint, model, overlap=prefill_overlaps)
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    batch = prompts(4, seed=5)
    for i, p in enumerate(batch):
        prefill.add_request(f"r{i}", p, first_params, hold_kv=True)
    firsts = {rid: toks for rid, toks in serve(prefill).tokens.items()}
    exports = {rid: prefill.export_kv(rid) for rid in firsts}
    for rid in firsts:
        assert prefill.release_kv(rid)
    assert prefill.blocks.num_free == prefill.blocks.num_blocks

    def drive(engine: Engine) -> Served:
        for i, p in enumerate(batch):
            rid = f"r{i}"
            engine.import_kv(rid, p, firsts[rid], GREEDY, exports[rid])
        return serve(engine)

    lockstep, overlapped, engine = both(checkpoint, model, drive)
    assert overlapped.tokens == lockstep.tokens and overlapped.reasons == lockstep.reasons
    assert engine.stats.prefill_tokens == 0  # every prompt came with its KV


def test_the_benchmark_drives_both_engines_through_asyncengine(checkpoint, tmp_path):
    """benchmarks/overlap_bench.py at a tiny size, on AsyncEngine's thread as a worker drives it: it raises if the
    two engines' greedy tokens differ, and writes a rate per run."""
    out = tmp_path / "overlap.json"
    argv = ["--model", str(checkpoint), "--batches", "1,3", "--steps", "3", "--repeats", "2", "--threads", "1"]
    overlap_bench.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["batches"]] == [1, 3] and report["config"]["driver"] == "async"
    for row in report["batches"]:
        assert len(row["off_runs"]) == len(row["on_runs"]) == 2 and row["on_tok_s"] > 0 and row["off_tok_s"] > 0


def test_an_overlapped_steps_clock_stamps_the_engine_threads_phases(checkpoint, model):
    """With overlap the step clock (shared/engine/step_clock.py) stamps what the engine thread does: planning,
    inputs and launch, the wait for the step in flight (`model`), the update."""
    engine = make_engine(checkpoint, model, overlap=True)
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    clock = StepClock()
    engine.time_steps(clock)
    serve(engine)
    assert clock.steps and all(set(s.phases) <= {"schedule", "inputs", "model", "update"} for s in clock.steps)
    assert sum("model" in s.phases for s in clock.steps) == engine.stats.overlapped_steps == 6
