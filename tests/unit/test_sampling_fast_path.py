"""The sampler's fast path (greedy and plain temperature: Sampler.sample_plain) equals the full path wherever both
apply: the same tokens for the same rows, seeds and positions; a row asking for logprobs (or any other feature)
takes the full path and still gets those tokens; and in an engine, the same tokens with and without logprobs."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import Sampler, SamplingParams

VOCAB = 300


def _logits(rows: int, seed: int, scale: float = 0.5) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _plain_batch(seed: int, rows: int = 12) -> list[SamplingParams]:
    """Greedy rows, seeded and unseeded temperature rows (1.0 among them), mixed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if kind == 0:
            out.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(temperature=1.0, seed=seed * 100 + i))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.3 + 0.2 * i, seed=i))
        else:
            out.append(SamplingParams(temperature=0.7))  # the engine-wide generator
    return out


@pytest.mark.parametrize(
    ("params", "plain"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.8, seed=3), True),
        (SamplingParams(temperature=0.0, top_p=0.5, min_p=0.1), True),  # a greedy row filters nothing
        (SamplingParams(temperature=0.8, top_p=0.9), False),
        (SamplingParams(temperature=0.8, min_p=0.05), False),
        (SamplingParams(temperature=0.8, top_k=5), False),
        (SamplingParams(temperature=0.7, top_k=1), False),  # greedy by top_k: its logits are divided first
        (SamplingParams(temperature=0.0, logprobs=0), False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), False),
        (SamplingParams(temperature=0.0, logit_bias=((3, 1.0),)), False),
    ],
)
def test_plain_names_the_rows_the_fast_path_takes(params, plain):
    assert params.plain is plain


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_tokens_equal_the_full_path(seed):
    logits, params = _logits(12, seed), _plain_batch(seed)
    positions = list(range(seed, seed + 12))
    fast = Sampler(seed=seed).sample_plain(logits, params, positions)
    full, logprobs = Sampler(seed=seed).sample_full(logits, params, positions)
    assert fast == full
    assert logprobs == [None] * 12
    # several steps in a row: the engine-wide generator advances alike on both paths
    a, b = Sampler(seed=seed), Sampler(seed=seed)
    for step in range(5):
        step_logits = _logits(12, 1000 * seed + step)
        assert a.sample_plain(step_logits, params, positions) == b.sample_full(step_logits, params, positions)[0]


def test_fast_path_leaves_the_logits_alone():
    logits = _logits(12, 9)
    before = logits.clone()
    Sampler(seed=0).sample_plain(logits, _plain_batch(9), list(range(12)))
    assert torch.equal(logits, before)


def test_sample_dispatches_plain_batches_to_the_fast_path_only(monkeypatch):
    sampler = Sampler(seed=0)
    calls = []
    full = sampler.sample_full
    monkeypatch.setattr(sampler, "sample_full", lambda *a, **k: calls.append(1) or full(*a, **k))
    logits, params = _logits(12, 1), _plain_batch(1)
    sampler.sample_with_logprobs(logits, params, list(range(12)))
    assert calls == []
    sampler.sample_with_logprobs(logits, [*params[:-1], SamplingParams(temperature=0.0, logprobs=2)], list(range(12)))
    assert calls == [1]  # one row asking for logprobs takes the whole batch down the full path


@pytest.mark.parametrize("seed", range(4))
def test_logprobs_requested_take_the_full_path_with_the_same_tokens(seed):
    """Seeded and greedy rows: asking for logprobs changes the path, not the tokens."""
    logits = _logits(12, seed)
    params = [p for p in _plain_batch(seed) if p.seed is not None or p.temperature == 0.0]
    positions = list(range(len(params)))
    fast = Sampler(seed=seed).sample_plain(logits[: len(params)], params, positions)
    asking = [SamplingParams(temperature=p.temperature, seed=p.seed, logprobs=3) for p in params]
    tokens, logprobs = Sampler(seed=seed + 1).sample_with_logprobs(logits[: len(params)], asking, positions)
    assert tokens == fast
    for row, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp is not None and len(lp.top_ids) == 3
        scaled = logits[row] / asking[row].scale
        assert lp.logprob == pytest.approx(torch.log_softmax(scaled.double(), -1)[token].item(), abs=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)])
def test_engine_tokens_are_the_same_on_both_paths(checkpoint, params):
    """Greedy / seeded temperature decode in an engine: the fast path (no logprobs) and the full one (logprobs
    asked) give the same tokens."""

    def run(p: SamplingParams) -> list[list[int]]:
        engine = Engine.from_dir(
            checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=128), num_kv_blocks=64, max_model_len=128
        )
        prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77, 12, 13, 14, 15]]
        return engine.generate(prompts, p)

    base = dict(max_tokens=12, ignore_eos=True, temperature=params.temperature, seed=params.seed)
    assert run(SamplingParams(**base)) == run(SamplingParams(**base, logprobs=2))
