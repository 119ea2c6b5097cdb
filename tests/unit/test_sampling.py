"""SamplingParams validation and the Sampler: greedy, seeds, top-k, top-p."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.sampling import Sampler, SamplingParams, filter_logits

VOCAB = 40
NUM_DRAWS = 1500


def fixed_logits(seed: int = 1234, scale: float = 1.0) -> torch.Tensor:
    """A reproducible (V,) float32 logits vector with distinct values."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    assert len(set(logits.tolist())) == VOCAB
    return logits


def ranked(logits: torch.Tensor, temperature: float = 1.0) -> list[tuple[int, float]]:
    """(token, probability) by falling probability, computed in float64 pure Python."""
    values = [v / temperature for v in logits.tolist()]
    m = max(values)
    exps = [math.exp(v - m) for v in values]
    z = sum(exps)
    return sorted(((i, e / z) for i, e in enumerate(exps)), key=lambda t: -t[1])


def expected_top_k(logits: torch.Tensor, k: int) -> set[int]:
    return {i for i, _ in ranked(logits)[:k]}


def expected_nucleus(logits: torch.Tensor, top_p: float, temperature: float = 1.0) -> set[int]:
    """Smallest set of most likely tokens whose probability reaches top_p. Asserts top_p is not within
    float noise of a cumulative boundary, so the expected set is unambiguous."""
    keep: set[int] = set()
    cumulative = 0.0
    for token, p in ranked(logits, temperature):
        assert abs(cumulative - top_p) > 1e-4, "top_p too close to a boundary for a robust test"
        if cumulative >= top_p:
            break
        keep.add(token)
        cumulative += p
    return keep


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int = NUM_DRAWS) -> list[int]:
    batch = logits.unsqueeze(0).expand(n, -1).contiguous()
    return sampler.sample(batch, [params] * n, list(range(n)))


# ---- SamplingParams validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -3},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"logit_bias": ((3, 101.0),)},
        {"logprobs": -1},
        {"temperature": -0.01},
        {"temperature": 100.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.0001},
        {"top_k": 0},
        {"top_k": -1},
    ],
)
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 1},
    ],
)
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


# ---- greedy ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = [max(range(VOCAB), key=lambda j, row=row: row[j]) for row in logits.tolist()]
    sampler = Sampler(seed=0)
    assert sampler.sample(logits, [SamplingParams(temperature=0.0)] * 6, list(range(6))) == expected
    # top_k=1 is greedy whatever the temperature
    assert sampler.sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 6, [0] * 6) == expected


def test_greedy_rows_unaffected_by_sampled_rows_in_the_same_batch():
    logits = fixed_logits().unsqueeze(0).repeat(3, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0), SamplingParams(temperature=0.0)]
    argmax = int(fixed_logits().argmax())
    for _ in range(20):
        out = Sampler().sample(logits, params, [0, 0, 0])
        assert out[0] == argmax and out[2] == argmax


# ---- seeds ----------------------------------------------------------------------------------------------


def test_seed_reproduces_the_token_at_each_position():
    logits = fixed_logits(scale=0.3)  # flat: a seed must matter
    params = SamplingParams(temperature=1.0, seed=42)
    a = [Sampler(seed=1).sample(logits[None], [params], [pos])[0] for pos in range(30)]
    b = [Sampler(seed=2).sample(logits[None], [params], [pos])[0] for pos in range(30)]
    assert a == b  # the engine-wide generator plays no part for a seeded request
    assert len(set(a)) > 3  # different positions draw differently


def test_seeded_token_independent_of_batch_neighbours_and_history():
    logits = fixed_logits(scale=0.3)
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.0)
    alone = Sampler().sample(logits[None], [seeded], [5])[0]
    sampler = Sampler()
    for _ in range(10):
        sampler.sample(logits[None], [other], [0])  # advance the shared generator
    batch = logits.unsqueeze(0).repeat(3, 1)
    assert sampler.sample(batch, [other, seeded, other], [3, 5, 9])[1] == alone


def test_different_seeds_give_different_sequences():
    logits = fixed_logits(scale=0.3)
    seqs = [[Sampler().sample(logits[None], [SamplingParams(seed=s)], [pos])[0] for pos in range(20)] for s in (1, 2)]
    assert seqs[0] != seqs[1]


def test_engine_seed_makes_unseeded_sampling_reproducible():
    logits = fixed_logits(scale=0.3)
    params = SamplingParams(temperature=1.0)
    assert draw(Sampler(seed=99), logits, params, 50) == draw(Sampler(seed=99), logits, params, 50)
    assert draw(Sampler(seed=99), logits, params, 50) != draw(Sampler(seed=100), logits, params, 50)


# ---- top-k / top-p support ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5, 12])
def test_top_k_never_samples_outside_the_top_k(k):
    logits = fixed_logits(scale=0.5)
    expected = expected_top_k(logits, k)
    samples = draw(Sampler(seed=3), logits, SamplingParams(temperature=1.0, top_k=k))
    assert set(samples) <= expected
    assert set(samples) == expected  # and, with this many draws from a flat vector, hits all of it


@pytest.mark.parametrize(("top_p", "temperature"), [(0.3, 1.0), (0.55, 1.0), (0.8, 1.0), (0.5, 0.5), (0.9, 2.0)])
def test_top_p_never_samples_outside_the_nucleus(top_p, temperature):
    logits = fixed_logits()
    expected = expected_nucleus(logits, top_p, temperature)
    assert 1 < len(expected) < VOCAB
    samples = draw(Sampler(seed=4), logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert set(samples) <= expected
    assert len(set(samples)) > 1


def test_top_k_and_top_p_together_stay_inside_both():
    logits = fixed_logits(scale=0.5)
    allowed = expected_top_k(logits, 6) & expected_nucleus(logits, 0.5)
    samples = draw(Sampler(seed=5), logits, SamplingParams(temperature=1.0, top_k=6, top_p=0.5))
    assert set(samples) <= allowed
    assert len(set(samples)) > 1


def test_filter_logits_top_p_keeps_exactly_the_nucleus():
    logits = fixed_logits()
    for top_p in (0.2, 0.45, 0.7, 0.95):
        kept = {i for i, v in enumerate(filter_logits(logits, None, top_p).tolist()) if v != float("-inf")}
        assert kept == expected_nucleus(logits, top_p), top_p


def test_filter_logits_top_k_keeps_exactly_k_and_preserves_values():
    logits = fixed_logits()
    out = filter_logits(logits, 7, 1.0)
    kept = {i for i, v in enumerate(out.tolist()) if v != float("-inf")}
    assert kept == expected_top_k(logits, 7)
    assert torch.equal(out[list(kept)], logits[list(kept)])


def test_filter_logits_no_op_when_disabled_or_k_covers_vocab():
    logits = fixed_logits()
    assert torch.equal(filter_logits(logits, None, 1.0), logits)
    assert torch.equal(filter_logits(logits, VOCAB, 1.0), logits)
    assert torch.equal(filter_logits(logits, VOCAB + 10, 1.0), logits)


def test_filter_logits_tiny_top_p_keeps_only_the_argmax():
    logits = fixed_logits()
    out = filter_logits(logits, None, 1e-9)
    finite = [i for i, v in enumerate(out.tolist()) if v != float("-inf")]
    assert finite == [int(logits.argmax())]
    # and sampling with it is therefore deterministic
    samples = draw(Sampler(seed=6), logits, SamplingParams(temperature=1.0, top_p=1e-9), 200)
    assert set(samples) == {int(logits.argmax())}


def test_filter_logits_tiny_top_p_with_a_dominant_token():
    logits = torch.full((VOCAB,), -5.0)
    logits[17] = 50.0  # probability ~1: nucleus is that token for any top_p
    out = filter_logits(logits, None, 0.999)
    assert [i for i, v in enumerate(out.tolist()) if v != float("-inf")] == [17]


def test_sampling_does_not_modify_the_logits():
    logits = fixed_logits()
    before = logits.clone()
    batch = logits[None].clone()
    Sampler(seed=0).sample(batch, [SamplingParams(temperature=0.8, top_k=5, top_p=0.7)], [0])
    assert torch.equal(batch[0], before)
