"""Per-request sampling: parameters (validated at the edge) and a batched sampler.

Randomness is keyed by (seed, output position): the token at position i of a seeded request is the same
whether the request ran in one engine, was preempted and recomputed, or moved to another engine after
a KV hand-off.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from shared.structured.spec import StructuredSpec

_SEED_STRIDE = 1_000_003  # distinct generator states per output position
# Below this a temperature means greedy, as in vLLM: logits / t would overflow float32 and the softmax give NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: StructuredSpec | None = None  # the output must match it (shared/engine/structured.py)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or None for off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


class Sampler:
    """Samples on the logits' device; only the chosen ids cross to the host, in one copy per call.

    Generators live on that device too (one engine-wide stream per device for unseeded requests): a seeded
    request repeats its tokens on the same kind of device, but CPU and CUDA draw different streams.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed if seed is not None else random.getrandbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded requests draw from these

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """logits (N, V) float32; positions[i] = index of the output token being sampled for row i."""
        tokens = logits.argmax(dim=-1)  # (N,) on the device; sampled rows overwrite their entry
        for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i], p, pos)
        return tokens.cpu().tolist()

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, position: int) -> torch.Tensor:
        """→ the token id as a one-element tensor on the logits' device (no host read)."""
        probs = torch.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p), dim=-1)
        if p.seed is not None:
            gen = torch.Generator(logits.device).manual_seed((p.seed * _SEED_STRIDE + position) % (1 << 63))
        else:
            gen = self._engine_generator(logits.device)
        return torch.multinomial(probs, 1, generator=gen)[0]

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self._seed)
        return gen


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf. logits: (V,). Keeps at least one."""
    if top_k is not None and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
