"""Decode graphs (shared/engine/decode_graphs.py), proven on CPU: the static-buffer program that CUDA graphs
capture runs here under `EagerReplay` (capture = keep the callable, replay = run it again over whatever the
buffers hold), with the Triton kernels interpreted (TRITON_INTERPRET=1, tests/conftest.py). It must give
the eager path's tokens and logits with padding to buckets, the scratch block and the fixed split count; the
scratch block stays nobody's; and the captured step reads nothing on the host and launches fixed grids."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.config_fields import add_flags, from_args, from_env
from shared.engine.config import SchedulerConfig
from shared.engine.decode_graphs import (
    DecodeGraphs,
    EagerReplay,
    bucket_sizes,
    choose_backend,
)
from shared.engine.engine import Engine
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.model.kernels.choice import KernelChoice
from shared.settings import WorkerSettings
from tests.device_guard import DeviceGuard

pytest.importorskip("triton", reason="the kernels need triton")
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1 (tests/conftest.py)"
)

# max_model_len 1024 at block size 16: the decode kernel's fixed split count is 4 for buckets up to 8 (2 KV
# heads) while the eager path, seeing contexts under 256 tokens, runs 1 split: the split path is held to it.
MAX_MODEL_LEN, BLOCK = 1024, 16
MAX_SEQS = 8  # buckets 1, 2, 4, 8
# (arrival step, prompt, max_tokens): requests join and finish at different steps, so decode batches hold
# 1..7 sequences (3, 5, 6, 7 are not buckets) with ragged contexts across block boundaries
ARRIVALS = [
    (0, list(range(1, 4)), 9),
    (0, list(range(10, 27)), 6),
    (1, list(range(30, 61)), 12),
    (2, [7], 5),
    (4, list(range(70, 90)), 8),
    (4, list(range(5, 20)), 3),
    (6, list(range(100, 116)), 7),
]


# qwen3 (dense) in make test; the MoE checkpoint's captures (~4 min of Triton-interpreted graphs on 2 cores) in
# the slow tier, which CI runs too.
@pytest.fixture(scope="module", params=[pytest.param("qwen3_moe", marks=pytest.mark.slow), "qwen3"])
def checkpoint(request, tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny")


def make_engine(checkpoint, graphs: bool, device: str = "cpu", kernels=KernelChoice.TRITON) -> Engine:
    return Engine.from_dir(
        checkpoint,
        graph_backend=EagerReplay() if graphs else None,
        device=device,
        kernels=kernels,
        block_size=BLOCK,
        num_kv_blocks=96,
        max_model_len=MAX_MODEL_LEN,
        scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=32),
    )


def drive(engine: Engine) -> tuple[dict[str, list[int]], list[dict[str, torch.Tensor]]]:
    """Run ARRIVALS to completion: tokens per request, and each step's logits by request id."""
    tokens: dict[str, list[int]] = {}
    logits: list[dict[str, torch.Tensor]] = []
    step = 0
    while step == 0 or engine.has_unfinished() or any(at >= step for at, _, _ in ARRIVALS):
        for i, (at, prompt, n) in enumerate(ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                tokens[f"r{i}"] = []
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        logits.append({rid: t.clone() for rid, t in engine.last_logits.items()})
        engine.check_integrity()
        assert engine.runner.graphs is None or engine.kv_plan.num_blocks not in _held_blocks(engine)
        step += 1
    return tokens, logits


def _held_blocks(engine: Engine) -> set[int]:
    return {b for r in engine.requests.values() for b in r.block_table}


@interpreted
def test_replayed_steps_give_the_eager_tokens_and_logits(checkpoint, monkeypatch):
    batch_sizes: list[int] = []
    real_run = DecodeGraphs.run

    def counted(self, block_tables, context_lens, input_ids):
        batch_sizes.append(len(input_ids))
        return real_run(self, block_tables, context_lens, input_ids)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    want_tokens, want_logits = drive(make_engine(checkpoint, graphs=False))
    assert batch_sizes == []
    engine = make_engine(checkpoint, graphs=True)
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 8]
    got_tokens, got_logits = drive(engine)
    assert got_tokens == want_tokens
    assert all(len(got_tokens[f"r{i}"]) == n for i, (_, _, n) in enumerate(ARRIVALS))
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert got.keys() == want.keys()
        for rid in want:  # fp32; the graphs' 4 splits vs the eager 1 reorder the softmax sums only
            torch.testing.assert_close(got[rid], want[rid], rtol=1e-5, atol=1e-5)
    # decode-only steps replayed, at batch sizes between buckets too; prefill and mixed steps ran eagerly
    assert engine.runner.graph_steps == len(batch_sizes) > 0
    assert {3, 5, 6, 7} & set(batch_sizes) and 1 in batch_sizes
    assert engine.stats.steps > engine.runner.graph_steps


@interpreted
def test_the_scratch_block_is_nobodys(checkpoint):
    engine = make_engine(checkpoint, graphs=True)
    scratch = engine.kv_plan.num_blocks
    assert engine.pool.num_blocks == engine.blocks.num_blocks + 1 == scratch + 1
    assert engine.runner.graphs is not None and engine.runner.graphs.scratch_block == scratch
    taken = engine.blocks.allocate(engine.blocks.num_free)  # every block the manager can give
    assert scratch not in taken and sorted(taken) == list(range(scratch))
    engine.blocks.free(taken)
    engine.check_integrity()
    # capture wrote only padding rows: the scratch block has K/V, every other block is still zeros
    pool = engine.pool.tensor
    assert pool[:, :, scratch].abs().sum() > 0 and not pool[:, :, :scratch].any()


@interpreted
def test_a_one_token_chunk_that_does_not_sample_replays_too(checkpoint, monkeypatch):
    """Budget 4 with 3 decoding requests: a new 6-token prompt gets a 1-token chunk beside them, so the step is
    decode-shaped (every row one token) but one row does not sample: only the sampling rows' logits come back."""
    replays: list[tuple[int, int]] = []  # (rows, sampling rows) of each replayed step
    real_replay = ModelRunner._replay

    def counted(self, plan, input_ids, sampling):
        replays.append((len(plan.seqs), len(sampling)))
        return real_replay(self, plan, input_ids, sampling)

    monkeypatch.setattr(ModelRunner, "_replay", counted)
    runs = []
    for graphs in (False, True):
        backend = EagerReplay() if graphs else None
        engine = Engine.from_dir(checkpoint, graph_backend=backend, kernels=KernelChoice.TRITON, block_size=BLOCK,
                                 num_kv_blocks=32, max_model_len=256,
                                 scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4))  # fmt: skip
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"d{i}", [1 + i], params)
        engine.step()  # three 1-token prompts: their first tokens
        engine.add_request("late", list(range(40, 46)), params)
        partial = []
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            outs = engine.step()
            partial.append(sorted(o.request_id for o in outs))
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            partial[-1].append({r: t.clone() for r, t in engine.last_logits.items()})
        runs.append((tokens, partial, engine.runner.graph_steps))
    (want, want_steps, _), (got, got_steps, graph_steps) = runs
    assert got == want and graph_steps == len(replays) > 0
    assert (4, 3) in replays  # the step with the unsampled row went through the graph
    assert ["d0", "d1", "d2"] == want_steps[0][:3]  # the first step after: 3 decodes + 1 token of "late", unsampled
    for g, w in zip(got_steps, want_steps, strict=True):
        assert g[:-1] == w[:-1]
        for rid in w[-1]:
            torch.testing.assert_close(g[-1][rid], w[-1][rid], rtol=1e-5, atol=1e-5)


@interpreted
def test_overlapped_steps_replay_from_the_forward_thread(checkpoint):
    """Overlap scheduling (shared/engine/overlap.py) replays the graphs on its forward thread, the decode tokens
    filled in there: the lockstep graphs' tokens, the unsampled one-token chunk of the test above included."""
    runs = []
    for overlap in (False, True):
        engine = Engine.from_dir(checkpoint, graph_backend=EagerReplay(), kernels=KernelChoice.TRITON, block_size=BLOCK,
                                 num_kv_blocks=32, max_model_len=256, overlap_scheduling=overlap,
                                 scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4))  # fmt: skip
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"d{i}", [1 + i], params)
        tokens: dict[str, list[int]] = {}
        step = 0
        while engine.has_unfinished():
            if step == 1:  # the same plan in both: the second one made
                engine.add_request("late", list(range(40, 46)), params)
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
        runs.append((tokens, engine))
    (want, _), (got, engine) = runs
    assert got == want and len(got) == 4
    assert engine.runner.graph_steps > 0 and engine.stats.overlapped_steps > 0


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_graphs_are_off_where_they_cannot_run(model_dir, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_backend(False, cuda, KernelChoice.TRITON) == (None, "off (cuda_graphs setting)")
    assert choose_backend(True, cpu, KernelChoice.TRITON)[0] is None
    assert "graphs capture the Triton path only" in choose_backend(True, cuda, KernelChoice.TORCH)[1]
    with caplog.at_level(logging.INFO, logger="shared.engine"):
        engine = Engine.from_dir(model_dir, num_kv_blocks=8, max_model_len=128)
    assert engine.runner.graphs is None and engine.pool.num_blocks == 8
    assert "decode graphs: off (device cpu: CUDA graphs need CUDA)" in caplog.text
    # a forced backend is still turned off by the setting, and refused without the Triton kernels
    off = Engine.from_dir(model_dir, graph_backend=EagerReplay(), cuda_graphs=False, num_kv_blocks=8, max_model_len=128)
    assert off.runner.graphs is None
    with pytest.raises(ValueError, match="need kernels=triton"):
        Engine.from_dir(model_dir, graph_backend=EagerReplay(), num_kv_blocks=8, max_model_len=128)


@interpreted
def test_start_up_line(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="shared.engine"):
        engine = make_engine(checkpoint, graphs=True)
    assert engine.graph_capture is not None and engine.graph_capture.sizes == [1, 2, 4, 8]
    assert "decode graphs: 4 buckets [1, 2, 4, 8] captured in" in caplog.text
    assert "eager replay (CPU)" in caplog.text


@interpreted
def test_a_failed_capture_leaves_the_engine_eager(checkpoint, caplog):
    class Refuses(EagerReplay):
        name = "refusing"

        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level(logging.INFO, logger="shared.engine"):
        engine = Engine.from_dir(checkpoint, graph_backend=Refuses(), kernels=KernelChoice.TRITON, block_size=BLOCK,
                                 num_kv_blocks=16, max_model_len=128)  # fmt: skip
    assert engine.runner.graphs is None and engine.graph_capture is None
    assert "decode graphs: capture failed (refusing); every step runs eagerly" in caplog.text
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0]) == 3 and engine.runner.graph_steps == 0


def test_the_setting_parses_from_env_and_flag():
    assert from_env(WorkerSettings, {}).engine.cuda_graphs is True
    assert from_env(WorkerSettings, {"PDSERVE_CUDA_GRAPHS": "0"}).engine.cuda_graphs is False
    p = argparse.ArgumentParser()
    add_flags(p, WorkerSettings)
    assert from_args(WorkerSettings, p.parse_args(["--no-cuda-graphs"]), {}).engine.cuda_graphs is False
    assert from_args(WorkerSettings, p.parse_args([]), {"PDSERVE_CUDA_GRAPHS": "0"}).engine.cuda_graphs is False


class LaunchRecorder:
    """Stands in for a @triton.jit kernel on the meta device: records each launch's grid, runs nothing."""

    def __init__(self, name: str, grids: list) -> None:
        self.name, self.grids = name, grids

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append((self.name, tuple(grid)))

        return launch


def test_the_captured_step_reads_nothing_on_the_host_and_launches_fixed_grids(checkpoint, monkeypatch):
    """On the meta device under DeviceGuard any host read (.item(), .tolist(), a data-dependent shape) or a
    host tensor made inside the forward raises; the kernels' launches are recorded, so their wrappers (split
    choice, fused_moe's alignment and bound) run in full. Capture and replays with different batches must
    launch the same grids per bucket."""
    from shared.model.kernels import fused_moe, paged_decode_attention

    grids: list = []
    for module, name in (
        (paged_decode_attention, "_decode_kernel"),
        (paged_decode_attention, "_merge_splits_kernel"),
        (fused_moe, "_gate_up_kernel"),
        (fused_moe, "_down_kernel"),
    ):
        monkeypatch.setattr(module, name, LaunchRecorder(name, grids))
    engine = make_engine(checkpoint, graphs=False, device="meta", kernels=KernelChoice.TORCH)
    engine.model.use_kernels(KernelChoice.TRITON)  # resolve_kernels refuses triton on meta; the guard needs meta
    caches = engine.pool.layer_caches()
    graphs = DecodeGraphs(engine.model, caches, BLOCK, 95, MAX_MODEL_LEN, [4, 8], EagerReplay())
    guard = DeviceGuard(torch.device("meta"))
    guard.watch(engine.model)
    with guard:
        graphs.capture()  # bucket 8, then 4: the capture runs (warm-up) each step once
        captured = list(grids)
        guard.readbacks.clear()
        grids.clear()
        graphs.run([[1, 2], [3]], [20, 5], [11, 12])  # 2 rows → bucket 4
        graphs.run([[1, 2, 4], [5], [6], [7], [8]], [40, 1, 16, 3, 9], [1, 2, 3, 4, 5])  # 5 rows → bucket 8
    assert guard.readbacks == []  # nothing came back to the host: no sync in the step
    half = len(captured) // 2
    assert grids[:half] == captured[half:] and grids[half:] == captured[:half]  # bucket 4's, then bucket 8's
    assert any(name == "_merge_splits_kernel" for name, _ in captured)  # the fixed split count is > 1
    moe = "moe" in str(checkpoint)
    assert any(name == "_gate_up_kernel" for name, _ in captured) == moe
