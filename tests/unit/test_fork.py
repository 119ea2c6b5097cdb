"""n sequences of one prompt (shared/engine/fork.py): the prompt computed once, its KV shared by the choices
(full blocks shared, the partial one copied), each choice equal to a single request with its derived seed,
and every block accounted for after finish, abort and preemption."""

from __future__ import annotations

import pytest

from shared.choices import choice_request_id, choice_seed
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine, RequestOutput
from shared.engine.fork import Choice, choice_params
from shared.engine.sampling import SamplingParams

BLOCK = 4
PROMPT = [3, 17, 42, 5, 9, 11, 23, 8, 2, 31]  # 10 tokens: two full blocks of 4 and a partial one of 2
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)


def make_engine(model_dir, num_blocks: int = 64, prefix_caching: bool = True, **scheduler) -> Engine:
    return Engine.from_dir(
        model_dir,
        block_size=BLOCK,
        num_kv_blocks=num_blocks,
        max_model_len=min(128, num_blocks * BLOCK),
        enable_prefix_caching=prefix_caching,
        scheduler=SchedulerConfig(**scheduler),
    )


def group(params: SamplingParams, n: int, name: str = "g") -> list[Choice]:
    return [Choice(f"{name}/{i}", choice_params(params, i)) for i in range(n)]


def run(engine: Engine, on_step=None) -> dict[str, list[int]]:
    """Step to the end; every request's tokens in order. `on_step(engine, outputs)` runs after each step."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs: list[RequestOutput] = engine.step()
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_integrity()
        if on_step is not None:
            on_step(engine, outs)
    return tokens


def single(model_dir, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    engine = make_engine(model_dir)
    engine.add_request("one", prompt, params)
    return run(engine)["one"]


def test_choice_seed_is_seed_plus_index():
    assert [choice_seed(100, i) for i in range(3)] == [100, 101, 102]
    assert choice_seed(None, 2) is None
    assert [choice_request_id("cmpl-1", i) for i in range(3)] == ["cmpl-1", "cmpl-1_c1", "cmpl-1_c2"]
    assert choice_params(SAMPLED, 2).seed == SAMPLED.seed + 2
    assert choice_params(SamplingParams(seed=None), 2).seed is None


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one(model_dir):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    outs = engine.step()  # the prompt, once; all three first tokens
    assert sorted(o.request_id for o in outs) == ["g/0", "g/1", "g/2"]
    assert engine.stats.prefill_tokens == len(PROMPT)
    tables = [engine.requests[f"g/{i}"].block_table for i in range(3)]
    shared = tables[0][:2]  # the two full prompt blocks
    assert all(t[:2] == shared for t in tables)
    assert all(engine.blocks.ref_count(b) == 3 for b in shared)
    partial = [t[2] for t in tables]
    assert len(set(partial)) == 3 and all(engine.blocks.ref_count(b) == 1 for b in partial)
    # the copies hold the parent's K/V of the partial block's prompt tokens (positions 8, 9)
    cache = engine.pool.tensor
    for b in partial[1:]:
        assert cache[:, :, b, :2].equal(cache[:, :, partial[0], :2])
    engine.check_integrity()
    used_before = engine.blocks.num_blocks - engine.blocks.num_free
    assert used_before == 2 + 3  # an independent request each would take 3 blocks each: 9
    run(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prompt_of_whole_blocks_shares_every_block(model_dir):
    engine = make_engine(model_dir)
    prompt = PROMPT[:8]
    engine.add_group(prompt, group(SAMPLED, 2))
    engine.step()
    a, b = (engine.requests[f"g/{i}"].block_table for i in range(2))
    assert a == b and all(engine.blocks.ref_count(x) == 2 for x in a)
    engine.step()  # each writes its first token into a block of its own
    a, b = (engine.requests[f"g/{i}"].block_table for i in range(2))
    assert a[:2] == b[:2] and a[2] != b[2]
    run(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_each_choice_equals_a_single_request_with_its_derived_seed(model_dir):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    got = run(engine)
    expected = [single(model_dir, choice_params(SAMPLED, i)) for i in range(3)]
    assert [got[f"g/{i}"] for i in range(3)] == expected
    assert len({tuple(t) for t in expected}) > 1  # the seeds differ, so do the choices (the proof is not vacuous)
    assert engine.stats.prefill_tokens == len(PROMPT)


def test_greedy_choices_are_identical(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_group(PROMPT, group(params, 3))
    got = run(engine)
    assert got["g/0"] == got["g/1"] == got["g/2"] == single(model_dir, params)


def test_unseeded_choices_draw_independently(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    engine.add_group(PROMPT, group(params, 3))
    got = run(engine)
    assert len({tuple(t) for t in got.values()}) > 1


def test_abort_frees_every_choice_and_the_shared_blocks(model_dir):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    engine.step()
    engine.step()
    assert engine.abort("g/0")  # the parent first: the children still hold the shared blocks
    engine.check_integrity()
    shared = engine.requests["g/1"].block_table[:2]
    assert all(engine.blocks.ref_count(b) == 2 for b in shared)
    assert engine.abort("g/1") and engine.abort("g/2")
    engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished()


def test_aborting_the_parent_before_its_first_token_leaves_the_other_choices_running(model_dir):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    assert engine.abort("g/0")
    got = run(engine)  # g/1 computes the prompt in its place, g/2 is forked from it
    assert sorted(got) == ["g/1", "g/2"]
    assert [got[f"g/{i}"] for i in (1, 2)] == [single(model_dir, choice_params(SAMPLED, i)) for i in (1, 2)]
    assert engine.stats.prefill_tokens == len(PROMPT)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_child_aborted_before_the_fork_is_never_forked(model_dir):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    assert engine.abort("g/1")
    got = run(engine)
    assert sorted(got) == ["g/0", "g/2"] and "g/1" not in engine.requests
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2)])
def test_aborting_every_choice_before_the_first_token_frees_everything(model_dir, order):
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    assert all(engine.abort(f"g/{i}") for i in order)
    assert not engine.pending_forks and run(engine) == {}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_preemption_keeps_integrity_and_every_choice_correct(model_dir):
    # 8 blocks: the group takes 2 shared + 3 partial, then a block each as it grows past 12 and 16 tokens
    engine = make_engine(model_dir, num_blocks=8)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    got = run(engine)
    assert engine.stats.preemptions > 0
    assert [got[f"g/{i}"] for i in range(3)] == [single(model_dir, choice_params(SAMPLED, i)) for i in range(3)]
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_child_without_a_sequence_slot_waits_and_recomputes(model_dir, prefix_caching):
    # the parent and g/1 run; g/2 waits for a slot
    engine = make_engine(model_dir, max_num_seqs=2, prefix_caching=prefix_caching)
    engine.add_group(PROMPT, group(SAMPLED, 3))
    first = {o.request_id: o.new_token_ids for o in engine.step()}
    assert [r.request_id for r in engine.scheduler.waiting] == ["g/2"]
    got = {rid: first[rid] + tokens for rid, tokens in run(engine).items()}
    # g/2 recomputes prompt + its first token, less the prompt's two full blocks when they are cached
    cached = 2 * BLOCK if prefix_caching else 0
    assert engine.stats.prefill_tokens == 2 * len(PROMPT) + 1 - cached
    assert [got[f"g/{i}"] for i in range(3)] == [single(model_dir, choice_params(SAMPLED, i)) for i in range(3)]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_choice_that_ends_at_its_first_token_takes_no_block(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    engine.add_group(PROMPT, group(params, 3))
    outs = engine.step()
    assert all(o.finished for o in outs) and len(outs) == 3
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.requests


def test_held_group_keeps_the_parent_kv_for_export(model_dir):
    """What a prefill worker does: max_tokens 1 and hold_kv: one KV (the parent's) for every choice."""
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    engine.add_group(PROMPT, group(params, 3), hold_kv=True)
    outs = engine.step()
    assert [o.finished for o in outs] == [True] * 3
    kv = engine.export_kv("g/0")
    assert kv.num_tokens == len(PROMPT)
    for i in range(3):
        assert engine.release_kv(f"g/{i}")
    engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_imported_prompt_kv_forks_into_choices_equal_to_single_requests(model_dir):
    """The decode side: one KV (the prompt's) imported, forked into the other choices with the first tokens a
    prefill engine sampled; every choice continues exactly as one engine would have run it."""
    prefill = make_engine(model_dir)
    firsts = choice_params(SAMPLED, 0)
    prefill.add_group(PROMPT, group(SamplingParams(max_tokens=1, temperature=1.0, seed=SAMPLED.seed), 3), True)
    first = {o.request_id: o.new_token_ids for o in prefill.step()}
    kv = prefill.export_kv("g/0")
    decode = make_engine(model_dir)
    decode.import_kv("g/0", PROMPT, first["g/0"], firsts, kv)
    children = [Choice(f"g/{i}", choice_params(SAMPLED, i), tuple(first[f"g/{i}"])) for i in (1, 2)]
    assert decode.fork("g/0", children) == []
    assert decode.stats.prefill_tokens == 0
    got = run(decode)
    assert [first[f"g/{i}"] + got[f"g/{i}"] for i in range(3)] == [
        single(model_dir, choice_params(SAMPLED, i)) for i in range(3)
    ]
    assert decode.stats.prefill_tokens == 0 and decode.blocks.num_free == decode.blocks.num_blocks


def test_migrated_group_continues_each_choice(model_dir):
    """Choices that carry tokens (a migration) run as separate requests after their own tokens."""
    expected = [single(model_dir, choice_params(SAMPLED, i)) for i in range(2)]
    engine = make_engine(model_dir)
    engine.add_group(PROMPT, [Choice(f"g/{i}", choice_params(SAMPLED, i), tuple(expected[i][:3])) for i in range(2)])
    got = run(engine)
    assert [expected[i][:3] + got[f"g/{i}"] for i in range(2)] == expected


@pytest.mark.parametrize(
    "choices",
    [
        [],
        [Choice("a", SAMPLED), Choice("a", SAMPLED)],
        [Choice("a", SAMPLED), Choice("b", SAMPLED, (1,))],
    ],
)
def test_bad_groups_are_refused_and_queue_nothing(model_dir, choices):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError):
        engine.add_group(PROMPT, choices)
    assert not engine.requests and not engine.has_unfinished()


def test_fork_refuses_a_parent_without_its_prompt_kv(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("p", PROMPT, SAMPLED)
    with pytest.raises(ValueError):
        engine.fork("p", [Choice("c", SAMPLED, (1,))])
    assert "c" not in engine.requests
