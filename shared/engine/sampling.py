"""Per-request sampling: parameters (validated at the edge) and a batched sampler.

A step's logits go through logits_process.py (logit_bias → penalties → temperature), then the filters (min_p →
top_k → top_p), then argmax (greedy rows) or a draw. Logprobs (logprobs.py) come from the processed logits, before
the filters: the distribution the token was drawn from, less the truncation.

The fast path: a step whose every row is `plain` (greedy or plain temperature; no bias, penalties, filters or
logprobs) skips all of that but the temperature and the draws, and reads no histories: the same ops on the same
values as the full path, so the same tokens (tests/unit/test_sampling_fast_path.py holds them equal).

Randomness is keyed by (seed, output position): the token at position i of a seeded request is the same
whether the request ran in one engine, was preempted and recomputed, or moved to another engine after
a KV hand-off.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from shared import sampling_spec as spec
from shared.engine.logits_process import filter_batch, process_batch
from shared.engine.logprobs import TokenLogprobs, gather_logprobs
from shared.structured.spec import StructuredSpec

_SEED_STRIDE = 1_000_003  # distinct generator states per output position
# Below this a temperature means greedy, as in vLLM: logits / t would overflow float32 and the softmax give NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling, as shared/sampling_spec.py declares each field (range, default, meaning); built from
    the wire's Sampling by shared/worker/engine_factory.py. Sequences are tuples here: the params are hashable."""

    max_tokens: int = spec.MAX_TOKENS.default  # 0 = score the prompt only: computed (with its logprobs), no token
    temperature: float = spec.TEMPERATURE.default  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = spec.TOP_P.default
    top_k: int | None = spec.TOP_K.default  # None = off
    seed: int | None = spec.SEED.default
    stop_token_ids: tuple[int, ...] = spec.STOP_TOKEN_IDS.default
    ignore_eos: bool = spec.IGNORE_EOS.default
    presence_penalty: float = spec.PRESENCE_PENALTY.default  # over output tokens (OpenAI)
    frequency_penalty: float = spec.FREQUENCY_PENALTY.default  # over output tokens (OpenAI)
    repetition_penalty: float = spec.REPETITION_PENALTY.default  # over prompt + output tokens (HF / vLLM)
    min_p: float = spec.MIN_P.default
    logit_bias: tuple[tuple[int, float], ...] = spec.LOGIT_BIAS.default  # (token id, bias)
    logprobs: int | None = spec.LOGPROBS.default  # None = off
    prompt_logprobs: int | None = spec.PROMPT_LOGPROBS.default  # None = off
    structured: StructuredSpec | None = None  # the output must match it (shared/engine/structured.py)

    def __post_init__(self) -> None:
        for field in spec.SAMPLING_FIELDS:
            problem = field.problem(getattr(self, field.name))
            if problem is not None:
                raise ValueError(problem)
        bias = spec.LOGIT_BIAS.item_range
        if bias is not None and any(not bias.contains(b) for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be {bias.describe()}")

    @property
    def scale(self) -> float:
        """What the logits are divided by: the temperature, or 1 for a greedy temperature (below GREEDY_BELOW)."""
        return 1.0 if self.temperature < GREEDY_BELOW else self.temperature

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """True when bias or penalties change the logits (temperature aside)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @cached_property
    def plain(self) -> bool:
        """True when the token depends on the logits and the temperature alone: no bias, penalties, top_k or
        logprobs, and, unless greedy, no min_p or top_p (the sampler's fast path). Computed once per params
        (a frozen dataclass: cached_property writes the instance dict, not a field)."""
        if self.processes_logits or self.logprobs is not None or self.top_k is not None:
            return False
        return self.temperature < GREEDY_BELOW or (self.min_p == 0.0 and self.top_p >= 1.0)


class Sampler:
    """Samples on the logits' device; only the chosen ids cross to the host, in one copy per call.

    Generators live on that device too (one engine-wide stream per device for unseeded requests): a seeded
    request repeats its tokens on the same kind of device, but CPU and CUDA draw different streams.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed if seed is not None else random.getrandbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded requests draw from these

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: Sequence[tuple[list[int], list[int]]] | None = None,
    ) -> list[int]:
        """logits (N, V) float32; positions[i] = index of the output token being sampled for row i;
        histories[i] = row i's (prompt ids, output ids so far), needed when a row has penalties."""
        return self.sample_with_logprobs(logits, params, positions, histories)[0]

    def sample_with_logprobs(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: Sequence[tuple[list[int], list[int]]] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled ids, and for each row that asked (params.logprobs) the sampled token's logprob and the top
        alternatives under the processed logits; ids and logprobs cross to the host in one copy. Rows that are
        all `plain` take the fast path (`sample_plain`), any other batch the full one (`sample_full`)."""
        if all(p.plain for p in params):
            return self.sample_plain(logits, params, positions), [None] * len(params)
        return self.sample_full(logits, params, positions, histories)

    def sample_full(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: Sequence[tuple[list[int], list[int]]] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Every feature, any rows: bias, penalties, temperature, filters, draws, logprobs."""
        if histories is None:
            if any(p.has_penalties for p in params):
                raise ValueError("penalties need the rows' token histories")
            histories = [([], [])] * len(params)
        plain = not any(p.processes_logits or not p.greedy or p.logprobs is not None for p in params)
        processed = logits if plain else process_batch(logits, params, histories)
        tokens = processed.argmax(dim=-1)  # (N,) on the device; sampled rows overwrite their entry
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            probs = torch.softmax(filter_batch(processed[drawn], [params[i] for i in drawn]), dim=-1)
            for j, i in enumerate(drawn):
                tokens[i] = self._draw(probs[j], params[i], positions[i])
        return gather_logprobs(processed, tokens, [p.logprobs for p in params])

    def sample_plain(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """The fast path, for rows that are all `plain`: argmax, and for the rows that draw their logits over
        their temperature, softmax, one draw each. No copy of the logits, no filter, no history. The full path's
        values exactly: it divides every row by its scale too (a greedy row's is 1) and its filters leave a plain
        row as it is."""
        tokens = logits.argmax(dim=-1)  # (N,) on the device; drawn rows overwrite their entry
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            scaled = logits[drawn]  # (R, V), a copy
            temps = [params[i].scale for i in drawn]
            if any(t != 1.0 for t in temps):
                scaled /= torch.tensor(temps, dtype=scaled.dtype).to(scaled.device)[:, None]
            probs = torch.softmax(scaled, dim=-1)
            for j, i in enumerate(drawn):
                tokens[i] = self._draw(probs[j], params[i], positions[i])
        return tokens.cpu().tolist()

    def _draw(self, probs: torch.Tensor, p: SamplingParams, position: int) -> torch.Tensor:
        """→ the token id as a one-element tensor on the probabilities' device (no host read)."""
        if p.seed is not None:
            gen = torch.Generator(probs.device).manual_seed((p.seed * _SEED_STRIDE + position) % (1 << 63))
        else:
            gen = self._engine_generator(probs.device)
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
