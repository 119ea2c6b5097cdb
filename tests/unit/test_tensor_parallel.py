"""Tensor parallelism over real gloo ranks: a TP = 2 engine (SPMD, every rank runs the same requests) writes
token for token what the single-rank engine writes, for every architecture and for checkpoints with fewer KV
heads than ranks; each rank loads only its slices; layouts a model cannot take are refused.

Scenarios are batched into few spawns (each spawned rank imports torch, ~3 s)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import shared.model.loader as loader
from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.decode_graphs import EagerReplay
from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout
from shared.engine.sampling import SamplingParams
from shared.model.attention import Attention
from shared.model.config import ARCHITECTURES
from shared.model.kernels.choice import KernelChoice
from shared.model.loader import load_model, model_weight_bytes
from shared.model.transformer import CausalLM, DecoderLayer
from shared.parallel.launch import run_on_ranks
from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup
from shared.sharding.layout import LayoutError, ParallelLayout

NEW_TOKENS = 16
# 37 and 23 tokens through a 16-token step budget: prompts in chunks, sharing steps with decodes
PROMPTS = [list(range(3, 40)), list(range(100, 123)), [7, 8, 9]]
# (arch, size, prepack): every architecture; the single-KV-head variants (fewer KV heads than ranks) of the
# MoE architectures with the q/k norms and the shared expert, on the unpacked weights' paths
CASES = [(arch, "tiny", True) for arch in ARCHITECTURES] + [
    ("qwen3_moe", "tiny_mqa", False),
    ("olmoe", "tiny_mqa", False),
    ("qwen2_moe", "tiny_mqa", True),
]


def _config(model_dir: str, tp: int, prepack: bool, kernels: KernelChoice = KernelChoice.TORCH) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        tp=tp,
        threads=1,
        num_kv_blocks=64,
        max_model_len=256,
        prepack_weights=prepack,
        kernels=kernels,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )


def _generate(engine: Engine) -> list[list[int]]:
    return engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))


def _rank_generates(group: RankGroup, cases: list[tuple[str, bool]]) -> list[dict]:
    """Per case on this rank: the tokens, the KV pool's heads and blocks, the weight bytes."""
    out: list[dict] = [{"agreed": group.agree_min("test", 100 - group.rank)}]  # ranks offering different numbers
    for model_dir, prepack in cases:
        engine = Engine.build(_config(model_dir, group.world, prepack), group=group)
        out.append(
            {
                "tokens": _generate(engine),
                "kv_heads": engine.layout.held_kv_heads,
                "blocks": engine.kv_plan.num_blocks,
                "fingerprint": engine.layout.fingerprint,
                "weight_bytes": model_weight_bytes(engine.model),
            }
        )
    return out


def _rank_generates_with_kernels(group: RankGroup, model_dir: str) -> list[list[int]]:
    """The Triton kernels (interpreted on CPU) and decode-step replay (EagerReplay) over this rank's shard."""
    config = _config(model_dir, group.world, prepack=False, kernels=KernelChoice.TRITON)
    engine = Engine.build(config, graph_backend=EagerReplay(), group=group)
    assert engine.runner.graphs is not None, "decode steps were not replayed"
    return _generate(engine)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("tp")
    return {(a, s): write_demo_checkpoint(root / f"{a}-{s}", arch=a, size=s) for a, s, _ in CASES}


def test_tp2_greedy_output_matches_the_single_rank_engine_for_every_architecture(checkpoints):
    cases = [(str(checkpoints[a, s]), prepack) for a, s, prepack in CASES]
    reference = []
    for model_dir, prepack in cases:
        engine = Engine.build(_config(model_dir, 1, prepack))
        reference.append((_generate(engine), engine.layout.fingerprint, model_weight_bytes(engine.model)))
    ranks = run_on_ranks(2, _rank_generates, (cases,))
    assert [r.pop(0)["agreed"] for r in ranks] == [99, 99]
    for (arch, size, _), (tokens, fingerprint, full_bytes), *per_rank in zip(CASES, reference, *ranks, strict=True):
        for rank, got in enumerate(per_rank):
            assert got["tokens"] == tokens, f"{arch} {size}: rank {rank} differs from the single-rank engine"
            assert got["fingerprint"] == fingerprint  # the same model shape, whichever heads a rank holds
            assert got["weight_bytes"] < 0.75 * full_bytes, f"{arch} {size}: rank {rank} holds too much"
        kv_heads = [got["kv_heads"] for got in per_rank]
        # one KV head, or MLA's latent (one "head" all ranks hold whole): replicated
        one_head = size == "tiny_mqa" or ARCHITECTURES[arch].mla
        assert kv_heads == ([(0,), (0,)] if one_head else [(0,), (1,)])
        assert per_rank[0]["blocks"] == per_rank[1]["blocks"] == 64


MOE_CASES = [
    ("mixtral", "tiny"),
    ("olmoe", "tiny_mqa"),
    ("qwen2_moe", "tiny"),
    ("qwen3_moe", "tiny_mqa"),
    ("glm4_moe", "tiny"),  # its ungated shared experts and the dense first layer
    ("deepseek_v3", "tiny"),  # MLA split by heads with the latent replicated, beside expert parallelism
]


def _rank_generates_tp_with_ep(group: RankGroup, cases: list[tuple[str, str]]) -> list[list[list[int]]]:
    """TP = 2 with EP = 2 on the same two ranks: attention and the shared expert split by heads / width, the
    routed experts partitioned (each rank whole experts), in each combine mode."""
    out = []
    for model_dir, dispatch in cases:
        config = replace(_config(model_dir, 2, prepack=False), ep=2, ep_dispatch=EPDispatch(dispatch))
        engine = Engine.build(config, group=group)
        for moe in engine.model.sparse_layers().values():  # half the experts, each whole; attention split
            assert moe.experts.num_experts * 2 == moe.experts.total_experts and moe.dispatch is not None
            assert moe.experts.intermediate == engine.model.config.moe_intermediate_size
        assert engine.model.shard.split
        out.append(_generate(engine))
    return out


def test_tp2_with_ep2_matches_the_single_rank_engine_for_every_moe_architecture(checkpoints):
    dirs = [str(checkpoints[a, s]) for a, s in MOE_CASES]
    reference = [_generate(Engine.build(_config(d, 1, prepack=False))) for d in dirs]
    cases = [(d, str(mode)) for d in dirs for mode in EPDispatch]
    for rank, got in enumerate(run_on_ranks(2, _rank_generates_tp_with_ep, (cases,))):
        for (d, mode), tokens in zip(cases, got, strict=True):
            assert tokens == reference[dirs.index(d)], f"{Path(d).name} {mode}: rank {rank} differs"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")
def test_tp2_triton_kernels_and_decode_graphs_run_on_the_local_shards(checkpoints):
    pytest.importorskip("triton", reason="the kernels need triton")
    model_dir = str(checkpoints["qwen3_moe", "tiny_mqa"])  # one KV head, replicated: heads of width 16 per rank
    reference = _generate(Engine.build(_config(model_dir, 1, prepack=False)))
    for rank, tokens in enumerate(run_on_ranks(2, _rank_generates_with_kernels, (model_dir,))):
        assert tokens == reference, f"rank {rank} with the Triton kernels differs from the single-rank engine"


def _sharded_bytes(cfg_model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters a TP rank splits, bytes it replicates) of a single-rank model."""
    split = replicated = 0
    for name, p in cfg_model.named_parameters():
        size = p.numel() * p.element_size()
        if "norm" in name or "embed_tokens" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            replicated += size
        else:
            split += size
    return split, replicated


@pytest.mark.parametrize(("arch", "size"), [("qwen2_moe", "tiny"), ("olmoe", "tiny_mqa")])
def test_each_rank_loads_its_slices_only(checkpoints, monkeypatch, arch, size):
    model_dir = checkpoints[arch, size]
    full = load_model(model_dir)
    split, replicated = _sharded_bytes(full)
    full_params = dict(full.named_parameters())

    read: list[int] = []  # bytes of every tensor read from the files
    real_open = loader.safe_open

    class CountingFile:
        def __init__(self, path, framework):
            self._f = real_open(path, framework=framework)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            t = self._f.get_tensor(name)
            read.append(t.numel() * t.element_size())
            return t

        def get_slice(self, name):
            inner = self._f.get_slice(name)

            class Slice:
                def get_shape(self):
                    return inner.get_shape()

                def get_dtype(self):  # metadata: the loader's quantization check reads it, no data
                    return inner.get_dtype()

                def __getitem__(self, index):
                    t = inner[index]
                    read.append(t.numel() * t.element_size())
                    return t

            return Slice()

    monkeypatch.setattr(loader, "safe_open", CountingFile)
    layout = ParallelLayout(tp=2)
    for rank in range(2):
        read.clear()
        # loading needs no collective: a group handle without a process group is enough
        shard = load_model(model_dir, group=RankGroup(rank, 2, None), layout=layout)
        # the split weights: half each (the LM head's padded vocabulary rows are not read);
        # KV projections of a replicated KV head are read whole by both ranks
        kv_replicated = sum(
            p.numel() * p.element_size() for n, p in full_params.items() if size == "tiny_mqa" and "qkv" in n
        )
        assert sum(read) <= replicated + split / 2 + kv_replicated / 2 + 1024
        assert sum(read) < 0.7 * (split + replicated)
        assert model_weight_bytes(shard) < 0.7 * model_weight_bytes(full)
        # this rank's query heads' rows of layer 0's q_proj are the single-rank model's
        q, whole = _first_attention(shard), _first_attention(full)
        rows = slice(q.q_rows.start, q.q_rows.stop)
        assert torch.equal(q.qkv_proj[: q.q_size], whole.qkv_proj[rows])
        assert torch.equal(q.o_proj, whole.o_proj[:, rows])


def _first_attention(model: CausalLM) -> Attention:
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer.self_attn


def test_layouts_the_model_cannot_take_are_refused(checkpoints, tmp_path):
    model_dir = checkpoints["qwen3_moe", "tiny"]  # 4 heads, 2 KV heads, expert intermediate 32
    with pytest.raises(LayoutError, match="4 attention heads do not split over tp=3"):
        load_model(model_dir, group=RankGroup(0, 3, None), layout=ParallelLayout(tp=3))
    with pytest.raises(LayoutError, match="tp=8 is not a multiple|8 attention heads|do not split over tp=8"):
        load_model(model_dir, group=RankGroup(0, 8, None), layout=ParallelLayout(tp=8))
    odd = tmp_path / "odd"  # the model is built (and refused) before any weight is read: a config is enough
    odd.mkdir()
    raw = json.loads((model_dir / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(raw | {"moe_intermediate_size": 33}))
    with pytest.raises(LayoutError, match="the experts' intermediate size of 33 does not split into 2 equal parts"):
        load_model(odd, group=RankGroup(1, 2, None), layout=ParallelLayout(tp=2))
    with pytest.raises(LayoutError, match="needs 2 ranks, the group has 1"):
        load_model(model_dir, layout=ParallelLayout(tp=2))
    with pytest.raises(LayoutError, match="each 1 or the group size"):
        EngineConfig(model=str(model_dir), tp=2, ep=4)
    with pytest.raises(ValueError, match="needs a group of 2 ranks"):
        Engine.build(EngineConfig(model=str(model_dir), tp=2))


def test_a_ranks_kv_layout_names_its_heads_and_keeps_the_models_fingerprint():
    whole = KVLayout(2, 2, 16, 16, "float32")
    rank1 = KVLayout(2, 2, 16, 16, "float32", kv_heads=(1,))
    assert whole.held_kv_heads == (0, 1) and whole.num_held_kv_heads == 2
    assert rank1.held_kv_heads == (1,) and rank1.num_held_kv_heads == 1
    assert rank1.fingerprint == whole.fingerprint  # the same model shape
    assert rank1.bytes_per_block * 2 == whole.bytes_per_block
    assert KVLayout(2, 1, 16, 16, "float32").fingerprint != whole.fingerprint  # a model with one KV head
    with pytest.raises(ValueError, match="must be distinct ids below num_kv_heads=2"):
        KVLayout(2, 2, 16, 16, "float32", kv_heads=(0, 2))
