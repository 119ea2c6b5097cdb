"""Penalties, logit_bias and min_p on crafted logits, each against its definition computed by hand (pure Python),
and the batched filters and logprobs against the per-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.logits_process import filter_batch, process_batch
from shared.engine.logprobs import gather_logprobs
from shared.engine.sampling import Sampler, SamplingParams, filter_logits

V = 12


def crafted(seed: int = 7) -> torch.Tensor:
    """Logits of both signs (the repetition penalty treats them differently), all distinct."""
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def test_presence_and_frequency_follow_openai():
    logits = crafted()
    prompt, output = [1, 2, 2], [3, 3, 3, 5, 1]
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)
    got = process_batch(logits[None], [p], [(prompt, output)])[0].tolist()
    for t, value in enumerate(logits.tolist()):
        count = output.count(t)  # output tokens only: the prompt's 2 is not penalised
        assert got[t] == pytest.approx(value - 0.4 * -1 * count - 0.7 * (count > 0), abs=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = crafted()
    prompt, output = [0, 1, 4], [6, 7]
    seen = set(prompt) | set(output)
    assert any(logits[t] > 0 for t in seen) and any(logits[t] < 0 for t in seen)
    got = process_batch(logits[None], [SamplingParams(repetition_penalty=1.7)], [(prompt, output)])[0].tolist()
    for t, value in enumerate(logits.tolist()):
        want = (value / 1.7 if value > 0 else value * 1.7) if t in seen else value
        assert got[t] == pytest.approx(want, abs=1e-5)


def test_logit_bias_adds_and_comes_before_temperature():
    logits = crafted()
    p = SamplingParams(logit_bias=((2, 5.0), (9, -100.0)), temperature=0.5)
    got = process_batch(logits[None], [p], [([], [])])[0].tolist()
    for t, value in enumerate(logits.tolist()):
        bias = {2: 5.0, 9: -100.0}.get(t, 0.0)
        assert got[t] == pytest.approx((value + bias) / 0.5, abs=1e-4)


def test_bias_then_penalty_order():
    """The bias applies first: a token pushed positive by its bias is then divided by the repetition penalty."""
    logits = torch.full((V,), -1.0)
    p = SamplingParams(logit_bias=((3, 4.0),), repetition_penalty=2.0)
    got = process_batch(logits[None], [p], [([3], [])])[0]
    assert got[3].item() == pytest.approx((-1.0 + 4.0) / 2.0)


def test_rows_are_independent_in_one_batch():
    logits = torch.stack([crafted(1), crafted(2), crafted(3)])
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams(), SamplingParams(repetition_penalty=3.0)]
    hist = [([], [4, 4]), ([], [4, 4]), ([4], [])]
    got = process_batch(logits, params, hist)
    for i in range(3):
        alone = process_batch(logits[i : i + 1], [params[i]], [hist[i]])[0]
        assert torch.equal(got[i], alone)
    assert torch.equal(got[1], logits[1])


def test_min_p_drops_exactly_the_tokens_below_the_fraction_of_the_top():
    logits = crafted()
    probs = [math.exp(v) for v in logits.tolist()]
    z = sum(probs)
    probs = [q / z for q in probs]
    for min_p in (0.01, 0.1, 0.3, 0.9):
        kept = filter_batch(logits[None], [SamplingParams(min_p=min_p)])[0]
        want = {t for t, q in enumerate(probs) if q >= min_p * max(probs)}
        assert {t for t, v in enumerate(kept.tolist()) if v != float("-inf")} == want


@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.5), (4, 1.0), (3, 0.6), (None, 1e-9), (V + 3, 0.8)])
def test_batched_filters_equal_the_per_row_filter(top_k, top_p):
    rows = torch.stack([crafted(s) for s in range(5)])
    got = filter_batch(rows, [SamplingParams(top_k=top_k, top_p=top_p)] * 5)
    for i in range(5):
        assert torch.equal(got[i], filter_logits(rows[i], top_k, top_p))


def test_greedy_with_a_penalty_avoids_the_repeated_token():
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    sampler = Sampler(0)
    assert sampler.sample(logits, [SamplingParams(temperature=0.0)], [0], [([], [5])]) == [5]
    params = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert sampler.sample(logits, [params], [1], [([], [5])]) == [6]


def test_logprobs_are_the_log_softmax_of_the_processed_logits():
    logits = torch.stack([crafted(s) for s in range(4)])
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, seed=1, logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=1.3, seed=2, frequency_penalty=0.5, logprobs=5),
    ]
    hist = [([], []), ([], []), ([], []), ([], [0, 1, 1])]
    tokens, lps = Sampler(0).sample_with_logprobs(logits, params, [0, 0, 0, 3], hist)
    assert lps[2] is None
    for i in (0, 1, 3):
        ref = torch.log_softmax(process_batch(logits[i : i + 1], [params[i]], [hist[i]])[0].double(), dim=-1)
        lp = lps[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(ref[tokens[i]].item(), abs=1e-5)
        k = params[i].logprobs
        assert list(lp.top_ids) == ref.topk(k).indices.tolist() if k else lp.top_ids == ()
        assert list(lp.top_logprobs) == pytest.approx(ref.topk(k).values.tolist(), abs=1e-5) if k else True
    assert tokens[0] == int(logits[0].argmax())


def test_gather_logprobs_without_rows_reads_only_the_ids():
    tokens = torch.tensor([3, 1])
    ids, lps = gather_logprobs(torch.zeros(2, V), tokens, [None, None])
    assert ids == [3, 1] and lps == [None, None]


def test_penalties_without_histories_are_refused():
    with pytest.raises(ValueError, match="histories"):
        Sampler(0).sample(crafted()[None], [SamplingParams(presence_penalty=1.0)], [0])
