"""Per-request expert counts (decode routed by expert affinity): a prompt traced in a batch with others, over
chunked prefill steps, counts exactly what its own prompt routes when run alone (the model's per-expert counters),
and nothing of the others'; untraced requests cost no counts; decode steps are not counted."""

from __future__ import annotations

import torch

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(checkpoint, model) -> Engine:
    config = EngineConfig(
        model=str(checkpoint),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),  # prompts cut into chunks
        enable_prefix_caching=False,
    )
    return Engine.build(config, model=model)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in (23, 9, 31)]


def _alone(checkpoint, model, prompt: list[int]) -> dict[int, list[int]]:
    """What the prompt routes when computed alone: the model's counters over its prefill (max_tokens 1: one step
    set, no decode step)."""
    engine = _engine(checkpoint, model)
    engine.model.take_expert_load()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return {layer: c.tolist() for layer, c in engine.model.take_expert_load().items()}


def test_a_traced_prompt_counts_its_own_routing_in_a_batch(checkpoint, model) -> None:
    engine = _engine(checkpoint, model)
    _engine(checkpoint, model)  # another engine over the same weights shares the trace, never detaches this one's
    prompts = _prompts()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.trace_experts("r0")
    engine.trace_experts("r2")
    while engine.has_unfinished():
        engine.step()
    for i in (0, 2):
        got = engine.take_request_experts(f"r{i}")
        assert got == _alone(checkpoint, model, prompts[i]), i
        top_k = engine.model.config.router.top_k if engine.model.config.router else 0
        assert sum(map(sum, got.values())) == len(prompts[i]) * top_k * len(got)
    assert engine.take_request_experts("r1") == {}  # never traced
    assert engine.take_request_experts("r0") == {}  # taken once


def test_an_aborted_or_released_request_is_forgotten(checkpoint, model) -> None:
    engine = _engine(checkpoint, model)
    engine.add_request("a", _prompts()[0], GREEDY)
    engine.trace_experts("a")
    engine.step()
    engine.abort("a")
    assert engine.take_request_experts("a") == {}
    assert engine.runner.request_experts.trace is not None and not engine.runner.request_experts.trace.armed
