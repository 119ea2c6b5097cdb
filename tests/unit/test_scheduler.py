"""Scheduler driven with fake model outputs: no model, a real BlockManager.

Each `step` plans a batch, invents a token for every scheduled sequence that samples, and feeds it back
through `update_from_output`, as the engine does with the runner's output.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import SchedulePlan, Scheduler, SchedulerConfig, StepResult

EOS = 99
PLAIN_TOKEN = 7  # neither EOS nor any stop token used below


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    eos: tuple[int, ...] = (EOS,),
    max_model_len: int = 4096,
    **config,
) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), blocks, max_model_len, eos_token_ids=eos), blocks


def make_request(rid: str, prompt_len: int, hold_kv: bool = False, **params) -> Request:
    params.setdefault("max_tokens", 100)
    prompt = [(i * 13 + len(rid)) % 50 for i in range(prompt_len)]  # never EOS or a stop token
    return Request(rid, prompt, SamplingParams(**params), hold_kv=hold_kv)


def fake_sampled(plan: SchedulePlan, token_for: Callable[[Request], int]) -> dict[str, int]:
    return {s.request.request_id: token_for(s.request) for s in plan.seqs if s.samples}


def step(
    sched: Scheduler, token_for: Callable[[Request], int] = lambda r: PLAIN_TOKEN
) -> tuple[SchedulePlan, list[StepResult]]:
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, fake_sampled(plan, token_for))


def plan_summary(plan: SchedulePlan) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in plan.seqs]


def used_blocks(sched: Scheduler) -> int:
    return sum(len(r.block_table) for r in sched.running)


def run_to_completion(sched: Scheduler, max_steps: int = 1000, **kw) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched, **kw)
        sched.blocks.check_integrity()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


# ---- config -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_num_batched_tokens": -1},
    ],
)
def test_scheduler_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_non_chunked_budget_must_hold_a_whole_prompt():
    with pytest.raises(ValueError, match="whole prompt must fit"):
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=101)


def test_scheduler_config_non_chunked_budget_equal_to_model_len_is_fine():
    sched, _ = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    assert sched.config.max_num_batched_tokens == 64 and sched.max_model_len == 64


def test_request_token_slice_spans_prompt_and_output():
    r = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    assert r.num_tokens == 5
    assert r.token_slice(0, 2) == [1, 2]
    assert r.token_slice(3, 5) == [4, 5]
    assert r.token_slice(1, 4) == [2, 3, 4]
    assert r.token_slice(0, 5) == [1, 2, 3, 4, 5]


# ---- prefill ------------------------------------------------------------------------------------------


def test_batch_of_prompts_under_budget_prefills_in_one_step():
    sched, blocks = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", n) for i, n in enumerate([5, 6, 8])]
    for r in reqs:
        sched.add(r)
    plan, results = step(sched)
    assert plan_summary(plan) == [("r0", 5), ("r1", 6), ("r2", 8)]
    assert plan.num_tokens == 19
    assert not plan.preempted
    assert [(r.request.request_id, r.new_token_id, r.finished) for r in results] == [
        ("r0", PLAIN_TOKEN, False),
        ("r1", PLAIN_TOKEN, False),
        ("r2", PLAIN_TOKEN, False),
    ]
    for r in reqs:
        assert r.status is RequestStatus.RUNNING
        assert r.output_token_ids == [PLAIN_TOKEN]
        assert r.num_computed_tokens == len(r.prompt_token_ids)
    assert [len(r.block_table) for r in reqs] == [2, 2, 2]
    assert not sched.waiting
    assert blocks.num_free == 16 - 6
    blocks.check_integrity()


def test_long_prompt_is_chunked_and_only_last_chunk_samples():
    sched, blocks = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    r = make_request("long", 10)
    sched.add(r)

    plan, results = step(sched)
    assert plan_summary(plan) == [("long", 4)]
    assert results == [] and r.output_token_ids == []
    assert r.num_computed_tokens == 4 and len(r.block_table) == 1

    plan, results = step(sched)
    assert plan_summary(plan) == [("long", 4)]
    assert results == [] and r.output_token_ids == []
    assert r.num_computed_tokens == 8 and len(r.block_table) == 2

    plan = sched.schedule()
    assert plan_summary(plan) == [("long", 2)]
    assert plan.seqs[0].samples
    results = sched.update_from_output(plan, {"long": 11})
    assert [(x.request, x.new_token_id) for x in results] == [(r, 11)]
    assert r.output_token_ids == [11]
    assert r.num_computed_tokens == 10 and len(r.block_table) == 3

    plan, _ = step(sched)  # now a decode: one token
    assert plan_summary(plan) == [("long", 1)]
    assert r.num_computed_tokens == 11
    assert blocks.num_free == 16 - 3
    blocks.check_integrity()


def test_chunks_never_exceed_the_budget():
    sched, blocks = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=7)
    for i, n in enumerate([20, 3, 11]):
        sched.add(make_request(f"r{i}", n, max_tokens=4))
    while sched.has_unfinished():
        plan, _ = step(sched)
        assert 0 < plan.num_tokens <= 7
        blocks.check_integrity()
    assert blocks.num_free == 64


def test_decodes_come_first_and_get_one_token_each():
    sched, blocks = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    a, b = make_request("a", 3), make_request("b", 5)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled
    c = make_request("c", 30)
    sched.add(c)
    plan, results = step(sched)
    # a and b decode first, one token each, then c's first chunk gets the rest of the budget
    assert plan_summary(plan) == [("a", 1), ("b", 1), ("c", 14)]
    assert [r.request.request_id for r in results] == ["a", "b"]
    assert a.output_token_ids == [PLAIN_TOKEN] * 2 and b.output_token_ids == [PLAIN_TOKEN] * 2
    assert c.num_computed_tokens == 14 and c.output_token_ids == []
    blocks.check_integrity()


def test_continuous_batching_new_request_joins_while_others_decode():
    sched, blocks = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=32)
    a = make_request("a", 4, max_tokens=5)
    sched.add(a)
    step(sched)
    step(sched)
    assert len(a.output_token_ids) == 2
    b = make_request("b", 6, max_tokens=2)
    sched.add(b)
    plan, results = step(sched)
    assert plan_summary(plan) == [("a", 1), ("b", 6)]
    assert {r.request.request_id for r in results} == {"a", "b"}
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 1), ("b", 1)]
    assert b.is_finished and b.finish_reason is FinishReason.LENGTH and b.output_token_ids == [PLAIN_TOKEN] * 2
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 1)]
    assert a.is_finished and len(a.output_token_ids) == 5
    assert not sched.has_unfinished()
    assert blocks.num_free == 32
    blocks.check_integrity()


def test_max_num_seqs_caps_running():
    sched, blocks = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 3, max_tokens=2 if i == 0 else 10) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan, _ = step(sched)
    assert plan_summary(plan) == [("r0", 3), ("r1", 3)]
    assert sched.running == reqs[:2]
    assert list(sched.waiting) == reqs[2:]
    assert all(r.status is RequestStatus.WAITING and not r.block_table for r in reqs[2:])

    plan, _ = step(sched)  # r0 reaches max_tokens=2 and leaves: its slot frees after this step
    assert plan_summary(plan) == [("r0", 1), ("r1", 1)]
    assert reqs[0].is_finished and len(sched.running) == 1

    plan, _ = step(sched)
    assert plan_summary(plan) == [("r1", 1), ("r2", 3)]
    assert len(sched.running) == 2 and list(sched.waiting) == [reqs[3]]
    assert blocks.num_free == 64 - used_blocks(sched)
    blocks.check_integrity()


# ---- block pressure -----------------------------------------------------------------------------------


def test_requests_that_do_not_fit_wait_until_blocks_free():
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 12, max_tokens=1)  # 3 blocks
    b = make_request("b", 8, max_tokens=1)  # 2 blocks: only 1 left
    c = make_request("c", 2, max_tokens=1)  # would fit, but queues behind b (arrival order)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()
    assert plan_summary(plan) == [("a", 12)]
    assert list(sched.waiting) == [b, c]
    assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert blocks.num_free == 1
    blocks.check_integrity()

    sched.update_from_output(plan, fake_sampled(plan, lambda r: PLAIN_TOKEN))
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert blocks.num_free == 4

    plan, _ = step(sched)
    assert plan_summary(plan) == [("b", 8), ("c", 2)]
    assert b.is_finished and c.is_finished
    assert blocks.num_free == 4
    blocks.check_integrity()


def test_preemption_frees_newest_request_and_recomputes_it_later():
    sched, blocks = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 4, max_tokens=2)  # 1 block; its first decode needs a 2nd
    b = make_request("b", 7, max_tokens=3)  # 2 blocks
    sched.add(a)
    sched.add(b)
    plan, _ = step(sched, token_for=lambda r: 21)
    assert plan_summary(plan) == [("a", 4), ("b", 7)]
    assert blocks.num_free == 0
    e = make_request("e", 2, max_tokens=1)
    sched.add(e)  # queued behind; no room

    plan = sched.schedule()
    # a's decode needs a block: b, the newest, is preempted
    assert plan.preempted == [b]
    assert plan_summary(plan) == [("a", 1)]
    assert b.status is RequestStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [21]  # kept: recomputed later
    assert list(sched.waiting) == [b, e]  # back at the front
    assert sched.running == [a]
    assert len(a.block_table) == 2
    assert blocks.num_free == 1
    blocks.check_integrity()

    sched.update_from_output(plan, fake_sampled(plan, lambda r: 22))
    assert a.is_finished and a.output_token_ids == [21, 22]
    assert blocks.num_free == 3

    plan = sched.schedule()
    # b is recomputed: prompt and its output so far, in one piece; e fits in the last block
    assert plan_summary(plan) == [("b", 8), ("e", 2)]
    assert plan.seqs[0].samples
    sched.update_from_output(plan, fake_sampled(plan, lambda r: 23))
    assert b.output_token_ids == [21, 23]
    assert b.num_computed_tokens == 8
    assert e.is_finished

    run_to_completion(sched)
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_token_ids) == 3
    assert blocks.num_free == 3
    blocks.check_integrity()


def test_preemption_order_is_newest_first_and_waiting_order_is_kept():
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 4) for i in range(4)]  # one full block each
    for r in reqs:
        sched.add(r)
    step(sched)
    assert blocks.num_free == 0
    plan = sched.schedule()
    # r0 needs a block: r3 goes; r1 needs one: r2 goes; r2 and r3 do not get to run
    assert plan.preempted == [reqs[3], reqs[2]]
    assert plan_summary(plan) == [("r0", 1), ("r1", 1)]
    assert list(sched.waiting) == [reqs[2], reqs[3]]
    assert blocks.num_free == 0
    assert used_blocks(sched) == 4
    blocks.check_integrity()


def test_request_that_needs_a_block_preempts_itself_when_it_is_the_newest():
    sched, blocks = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 3)  # 1 block, room to decode once without a new block
    b = make_request("b", 4)  # 1 full block
    sched.add(a)
    sched.add(b)
    step(sched)
    plan = sched.schedule()
    assert plan.preempted == [b]
    assert plan_summary(plan) == [("a", 1)]
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    assert blocks.num_free == 1
    blocks.check_integrity()


def test_preempting_a_request_already_in_the_plan_removes_its_entry():
    # b decodes (imported KV: admitted after a); a's next prefill chunk needs b's blocks
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=4, max_model_len=16)
    a = make_request("a", 12)
    sched.add(a)
    step(sched)
    step(sched)
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=5), output_token_ids=[6])
    b.block_table = blocks.allocate(2)
    b.num_computed_tokens = 5  # decoding: token 6 goes into its 2nd block, no new block needed
    sched.add_running(b)
    assert blocks.num_free == 0

    plan = sched.schedule()
    # b's decode was planned first; a's chunk (3 tokens, the rest of the budget) needs a 3rd block
    assert plan.preempted == [b]
    assert all(s.request is not b for s in plan.seqs)
    assert plan_summary(plan) == [("a", 3)]
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert blocks.num_free == 4 - len(a.block_table)
    blocks.check_integrity()
    sched.update_from_output(plan, fake_sampled(plan, lambda r: PLAIN_TOKEN))
    assert b.output_token_ids == [6]
    run_to_completion(sched)
    assert blocks.num_free == 4


def test_request_preempted_in_a_step_is_not_readmitted_in_the_same_step():
    # Preempting b throws away its 9 computed tokens to give a one block. Re-admitting b at once into the
    # blocks it just released recomputes them for nothing, and b is then both in plan.preempted and running.
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    a = make_request("a", 3)
    b = make_request("b", 9)
    sched.add(a)
    sched.add(b)
    assert plan_summary(step(sched)[0]) == [("a", 3), ("b", 5)]
    assert plan_summary(step(sched)[0]) == [("a", 1), ("b", 4)]
    assert (a.num_computed_tokens, len(a.block_table)) == (4, 1)
    assert (b.num_computed_tokens, len(b.block_table)) == (9, 3)
    assert blocks.num_free == 0

    plan = sched.schedule()  # a's decode needs a 2nd block: b, the newest, is preempted
    assert plan.preempted == [b]
    assert plan_summary(plan) == [("a", 1)]
    assert list(sched.waiting) == [b] and b.status is RequestStatus.WAITING and b.block_table == []
    assert blocks.num_free == 2
    blocks.check_integrity()


# ---- abort --------------------------------------------------------------------------------------------


def test_abort_mid_decode_frees_blocks():
    sched, blocks = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_request("a", 9), make_request("b", 5)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    held = len(a.block_table)
    assert held == 3
    free_before = blocks.num_free
    sched.abort(a)
    assert a.is_finished and a.finish_reason is FinishReason.ABORT
    assert a.block_table == []
    assert blocks.num_free == free_before + held
    assert sched.running == [b]
    plan, _ = step(sched)
    assert plan_summary(plan) == [("b", 1)]
    blocks.check_integrity()


def test_abort_while_step_in_flight_discards_its_output():
    sched, blocks = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    plan = sched.schedule()
    sched.abort(a)
    results = sched.update_from_output(plan, fake_sampled(plan, lambda r: PLAIN_TOKEN))
    assert [r.request for r in results] == [b]
    assert a.output_token_ids == [PLAIN_TOKEN]  # no token appended after the abort
    assert a.finish_reason is FinishReason.ABORT
    assert blocks.num_free == 16 - len(b.block_table)
    blocks.check_integrity()


def test_abort_waiting_request():
    sched, blocks = make_scheduler(num_blocks=1, block_size=4)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert list(sched.waiting) == [b]
    sched.abort(b)
    assert not sched.waiting and b.finish_reason is FinishReason.ABORT
    assert blocks.num_free == 0  # a still holds its block
    sched.abort(a)
    assert not sched.has_unfinished()
    assert blocks.num_free == 1
    blocks.check_integrity()


def test_hold_kv_keeps_blocks_after_finish_but_not_after_abort():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    held = make_request("held", 6, hold_kv=True, max_tokens=1)
    aborted = make_request("aborted", 6, hold_kv=True)
    sched.add(held)
    sched.add(aborted)
    step(sched)
    assert held.is_finished and held.finish_reason is FinishReason.LENGTH
    assert len(held.block_table) == 2 and blocks.num_free == 8 - 4
    sched.abort(aborted)
    assert aborted.block_table == [] and blocks.num_free == 8 - 2
    blocks.check_integrity()
    blocks.free(held.block_table)
    assert blocks.num_free == 8


# ---- finishing ----------------------------------------------------------------------------------------


def test_stop_token_finishes_with_stop():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", 5, stop_token_ids=(42,), ignore_eos=True)
    sched.add(r)
    tokens = iter([3, 4, 42, 5])
    run_to_completion(sched, token_for=lambda req: next(tokens))
    assert r.output_token_ids == [3, 4, 42]
    assert r.finish_reason is FinishReason.STOP
    assert blocks.num_free == 8


def test_eos_finishes_with_stop():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", 5)
    sched.add(r)
    tokens = iter([3, EOS, 5])
    results = []
    while sched.has_unfinished():
        results += step(sched, token_for=lambda req: next(tokens))[1]
    assert r.output_token_ids == [3, EOS]
    assert r.finish_reason is FinishReason.STOP
    assert [x.finished for x in results] == [False, True]
    assert results[-1].new_token_id == EOS
    assert blocks.num_free == 8


def test_ignore_eos_runs_to_max_tokens():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", 5, ignore_eos=True, max_tokens=4)
    sched.add(r)
    run_to_completion(sched, token_for=lambda req: EOS)
    assert r.output_token_ids == [EOS] * 4
    assert r.finish_reason is FinishReason.LENGTH
    assert blocks.num_free == 8
    blocks.check_integrity()


def test_max_tokens_finishes_with_length():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", 5, max_tokens=3)
    one = make_request("one", 2, max_tokens=1)
    sched.add(r)
    sched.add(one)
    plan, results = step(sched)
    assert one.is_finished and one.output_token_ids == [PLAIN_TOKEN]
    assert [x.finished for x in results] == [False, True]
    run_to_completion(sched)
    assert len(r.output_token_ids) == 3
    assert r.finish_reason is FinishReason.LENGTH
    assert blocks.num_free == 8
    blocks.check_integrity()


def test_max_model_len_finishes_with_length():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4, max_model_len=10)
    r = make_request("r", 7, max_tokens=100)
    sched.add(r)
    run_to_completion(sched)
    assert r.num_tokens == 10 and len(r.output_token_ids) == 3
    assert r.finish_reason is FinishReason.LENGTH
    assert blocks.num_free == 8
    blocks.check_integrity()


def test_stop_beats_length_on_the_same_token():
    sched, _ = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", 3, max_tokens=1, stop_token_ids=(5,))
    sched.add(r)
    step(sched, token_for=lambda req: 5)
    assert r.finish_reason is FinishReason.STOP


# ---- without chunked prefill --------------------------------------------------------------------------


def test_non_chunked_runs_prefill_only_steps_of_whole_prompts():
    sched, blocks = make_scheduler(
        num_blocks=64, block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    a = make_request("a", 5)
    sched.add(a)
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 5)]
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 1)]

    b, c = make_request("b", 20), make_request("c", 20)  # do not fit one step together
    sched.add(b)
    sched.add(c)
    plan, _ = step(sched)
    assert plan_summary(plan) == [("b", 20)]  # a's decode stalls: a prefill-only step
    assert list(sched.waiting) == [c]
    plan, _ = step(sched)
    assert plan_summary(plan) == [("c", 20)]  # c whole, never chunked
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 1), ("b", 1), ("c", 1)]
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 2 and len(c.output_token_ids) == 2
    blocks.check_integrity()
    assert blocks.num_free == 64 - used_blocks(sched)


def test_non_chunked_packs_several_whole_prompts_in_one_step():
    sched, blocks = make_scheduler(
        num_blocks=64, block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    for rid, n in [("a", 10), ("b", 12), ("c", 11), ("d", 3)]:
        sched.add(make_request(rid, n, max_tokens=2))
    plan, _ = step(sched)
    assert plan_summary(plan) == [("a", 10), ("b", 12)]  # c would exceed the budget; d waits behind it
    plan, _ = step(sched)
    assert plan_summary(plan) == [("c", 11), ("d", 3)]
    run_to_completion(sched)
    assert blocks.num_free == 64
    blocks.check_integrity()


# ---- randomized workload ------------------------------------------------------------------------------


def expected_token(rid: str, position: int) -> int:
    return (sum(map(ord, rid)) * 31 + position * 17) % 90  # never EOS (99)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants(seed, chunked):
    rng = random.Random(seed)
    num_blocks, block_size, model_len = 12, 4, 32
    sched, blocks = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=5,
        max_num_batched_tokens=32 if not chunked else 10,
        enable_chunked_prefill=chunked,
        max_model_len=model_len,
    )
    all_reqs: list[Request] = []
    aborted: set[str] = set()
    preemptions = 0
    for t in range(400):
        if t < 200 and rng.random() < 0.3:
            r = make_request(f"q{t}", rng.randint(1, 20), max_tokens=rng.randint(1, 12))
            all_reqs.append(r)
            sched.add(r)
        if rng.random() < 0.03:
            live = [r for r in all_reqs if not r.is_finished]
            if live:
                victim = rng.choice(live)
                sched.abort(victim)
                aborted.add(victim.request_id)
        decoding_before = {r.request_id for r in sched.running if r.num_computed_tokens == r.num_tokens - 1}
        plan = sched.schedule()
        preemptions += len(plan.preempted)
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        ids = [s.request.request_id for s in plan.seqs]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        # (a preempted request re-admitted in the same step is covered by its own test below)
        decoding_before -= {r.request_id for r in plan.preempted}
        decoding = [s.request.request_id in decoding_before for s in plan.seqs]
        assert all(s.num_tokens == 1 for s, d in zip(plan.seqs, decoding, strict=True) if d)
        assert decoding == sorted(decoding, reverse=True), "decodes must come first"
        for s in plan.seqs:
            r = s.request
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_table) >= blocks.blocks_for(r.num_computed_tokens + s.num_tokens)
            assert r.num_computed_tokens + s.num_tokens <= r.num_tokens
        sched.update_from_output(
            plan, fake_sampled(plan, lambda r: expected_token(r.request_id, len(r.output_token_ids)))
        )
        blocks.check_integrity()
        assert blocks.num_free == num_blocks - used_blocks(sched)
        for r in sched.waiting:
            assert r.block_table == [] and r.num_computed_tokens == 0
        if t >= 200 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert blocks.num_free == num_blocks
    assert preemptions > 0, "workload too light to exercise preemption"
    for r in all_reqs:
        assert r.is_finished
        want = [expected_token(r.request_id, i) for i in range(len(r.output_token_ids))]
        assert r.output_token_ids == want  # no token lost or duplicated across preemptions
        if r.request_id not in aborted:
            assert r.finish_reason is FinishReason.LENGTH
            assert len(r.output_token_ids) == min(r.params.max_tokens, model_len - len(r.prompt_token_ids))
