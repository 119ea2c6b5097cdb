"""Data-parallel attention's host-side pieces: the layout and settings it refuses, the leader's partitioned block
manager (a request's blocks on one rank, the least loaded), and how a step is cut into the ranks' slices."""

from __future__ import annotations

import dataclasses

import pytest

from services.demo_model import write_demo_checkpoint
from shared.engine.block_manager import FREED, NoFreeBlocksError
from shared.engine.config import EngineConfig, EplbConfig
from shared.engine.dp_blocks import DpBlockManager, running_per_rank
from shared.engine.dp_step import DpSlice, seq_rank
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from shared.engine.step_inputs import StepInputs
from shared.messages import Heartbeat, Role
from shared.model.loader import load_model
from shared.sharding.group import RankGroup
from shared.sharding.layout import LayoutError, ParallelLayout
from shared.worker.engine_load import EngineLoad


def test_the_layout_takes_dp_only_with_ep_over_the_same_ranks_and_no_tp() -> None:
    layout = ParallelLayout(ep=4, dp=4)
    assert layout.world == 4 and layout.data_parallel and str(layout) == "tp=1 ep=4 dp=4"
    assert not ParallelLayout(ep=4).data_parallel
    with pytest.raises(LayoutError, match="--ep 4, --tp 1"):
        ParallelLayout(tp=4, ep=4, dp=4)
    with pytest.raises(LayoutError, match="--ep 2, --tp 1"):
        ParallelLayout(ep=1, dp=2)


def test_settings_refuse_dp_attention_without_ep_or_with_tp(tmp_path) -> None:
    assert EngineConfig(model="m", ep=2, dp_attention=True).parallel == ParallelLayout(ep=2, dp=2)
    with pytest.raises(ValueError, match="needs --ep > 1"):
        EngineConfig(model="m", dp_attention=True)
    with pytest.raises(ValueError, match="without tensor parallelism"):
        EngineConfig(model="m", tp=2, ep=2, dp_attention=True)
    assert EngineConfig(model="m", ep=2, dp_attention=True, eplb=EplbConfig(enabled=True)).eplb.enabled


def test_a_requests_blocks_stay_on_one_rank_and_new_ones_go_to_the_least_loaded() -> None:
    blocks = DpBlockManager(world=3, per_rank=4, block_size=2)
    seqs = [0, 0, 0]
    blocks.seqs_of = lambda: seqs
    a = blocks.allocate(2)  # every rank idle and empty: the lowest
    assert {b % 3 for b in a} == {0} and [b // 3 for b in a] == [0, 1]
    seqs[0] = 1
    b = blocks.allocate(1)
    assert b == [1]  # rank 1: fewest sequences, then most free blocks
    seqs[1] = 1
    assert blocks.allocate(1) == [2]
    seqs[2] = 1
    grown = blocks.allocate(2, after=a[-1])  # extends a's run on rank 0
    assert grown == [6, 9] and blocks.rank_free(0) == 0
    assert not blocks.can_allocate(1, after=a[-1]) and blocks.can_allocate(3)
    with pytest.raises(NoFreeBlocksError, match="on one DP rank"):
        blocks.allocate(1, after=a[-1])
    assert not blocks.can_allocate(4)  # 6 free in all, but no rank holds 4
    blocks.free(a + grown)
    assert blocks.rank_free(0) == 4 and blocks.num_free == 10
    blocks.free([FREED])  # a table entry freed behind a window holds nothing
    blocks.check_integrity()


def test_running_sequences_are_counted_on_the_rank_of_their_blocks() -> None:
    reqs = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(4)]
    reqs[0].block_table, reqs[1].block_table, reqs[2].block_table = [4, 7], [FREED, 5], [1]
    assert running_per_rank(reqs, 3) == [0, 2, 1]  # r3 has no block yet: nowhere


def _inputs() -> StepInputs:
    """Three sequences over 2 ranks (global block g on rank g % 2): a decode on rank 1, a prompt chunk of 3 on
    rank 0 that samples, a decode on rank 1; one scoring slice over the chunk's first two rows."""
    return StepInputs(
        input_ids=[11, 21, 22, 23, 31],
        positions=[9, 0, 1, 2, 4],
        block_tables=[[1, 3, 5], [0, 2], [FREED, 7]],
        context_lens=[10, 3, 5],
        query_lens=[1, 3, 1],
        sample_rows=[0, 3, 4],
        score_rows=[(1, 2)],
    )


def test_each_rank_cuts_its_own_sequences_with_local_blocks_and_the_rows_it_holds() -> None:
    inputs = _inputs()
    assert [seq_rank(t, 2) for t in inputs.block_tables] == [1, 0, 1]
    zero, one = DpSlice.of(inputs, 0, 2), DpSlice.of(inputs, 1, 2)
    assert zero.inputs.input_ids == [21, 22, 23] and zero.inputs.positions == [0, 1, 2]
    assert zero.inputs.block_tables == [[0, 1]] and zero.inputs.context_lens == [3]
    assert one.inputs.input_ids == [11, 31] and one.inputs.block_tables == [[0, 1, 2], [FREED, 3]]
    assert one.inputs.query_lens == [1, 1] and one.inputs.sample_rows == [] == one.inputs.score_rows
    # needed rows, in order: the samples (flat 0, 3, 4), then the scoring slice's rows (flat 1, 2)
    assert zero.held == one.held == [[(1, 2), (3, 0), (4, 1)], [(0, 0), (2, 1)]]
    assert zero.num_needed == 5


def test_a_rank_without_sequences_gets_an_empty_slice_and_holds_no_needed_row() -> None:
    inputs = _inputs()
    three = dataclasses.replace(inputs, block_tables=[[1, 4, 7], [0, 3], [FREED, 4]])  # ranks 1, 0, 1 of 3
    part = DpSlice.of(three, 2, 3)
    assert part.inputs.input_ids == [] and part.inputs.block_tables == [] and part.held[2] == []
    assert part.held[0] == [(1, 2), (3, 0), (4, 1)]


def test_a_model_without_routed_experts_is_refused_before_any_weight_is_read(tmp_path) -> None:
    dense = write_demo_checkpoint(tmp_path / "dense", arch="qwen3")
    with pytest.raises(LayoutError, match="has no routed experts"):
        load_model(dense, group=RankGroup(0, 2, None), layout=ParallelLayout(ep=2, dp=2))


def test_a_dp_groups_room_and_fit_are_its_freest_ranks() -> None:
    load = EngineLoad(
        running=3, waiting=0, waiting_tokens=0, free_blocks=12, total_blocks=40, prefill_tokens=0, decode_tokens=0,
        requests=frozenset(), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
        vocab_size=100, dp_running=(2, 1), dp_free_blocks=(1, 11),
    )  # fmt: skip
    assert load.usage == 0.7 and load.fit_usage == pytest.approx(0.45)  # rank 1: 11 of 20 free
    assert load.has_room()
    full = dataclasses.replace(load, free_blocks=3, dp_free_blocks=(1, 2))
    assert not full.has_room()  # 92.5 % in use overall, and no rank has 10 % free
    beat = Heartbeat(worker_id="w", role=Role.DECODE, model="m", rpc_address=None, free_blocks=12,
                     dp_rank_free_blocks=(1, 11))  # fmt: skip
    assert beat.fit_blocks == 11 and Heartbeat("w", Role.DECODE, "m", None, free_blocks=12).fit_blocks == 12
