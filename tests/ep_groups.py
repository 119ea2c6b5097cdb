"""What the expert-parallel group tests share (tests/integration/test_eplb_group.py, test_ep4.py): one small
engine configuration over the tiny qwen3_moe demo (8 experts), and seeded random prompts."""

from __future__ import annotations

import torch

from shared.engine.config import EngineConfig, SchedulerConfig


def ep_config(model_dir, **kw) -> EngineConfig:
    """A small engine over `model_dir` (1 thread, a 64-block pool, steps of 24 tokens); `kw` overrides or adds."""
    base = dict(
        model=str(model_dir),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=96,
        threads=1,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
    )
    return EngineConfig(**(base | kw))


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
