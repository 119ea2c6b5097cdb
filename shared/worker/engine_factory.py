"""The engine a worker runs, and the engine's sampling parameters from a job's."""

from __future__ import annotations

import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.messages import Sampling
from shared.settings import WorkerSettings


def sampling_params(s: Sampling, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return Engine(
        EngineConfig(
            model=settings.model,
            dtype=settings.dtype,
            device=settings.device,
            block_size=settings.block_size,
            kv_cache_bytes=settings.kv_cache_bytes,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            max_model_len=settings.max_model_len,
        )
    )
