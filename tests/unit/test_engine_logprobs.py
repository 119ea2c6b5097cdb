"""Logprobs and prompt logprobs out of a real engine, against the engine's own logits and against transformers on
the same checkpoint; max_tokens 0 (score only); penalties identical across a KV hand-off between two engines."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine, RequestOutput
from shared.engine.request import FinishReason
from shared.engine.sampling import SamplingParams
from shared.structured import spec as specs

BUDGET = 16  # prompts longer than this are prefilled in chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("lp"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def engine(checkpoint) -> Engine:
    return Engine.from_dir(
        checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET), num_kv_blocks=64, max_model_len=256
    )


def run(e: Engine, prompt: list[int], params: SamplingParams, rid: str = "r") -> list[RequestOutput]:
    e.add_request(rid, prompt, params)
    outs = []
    while e.has_unfinished():
        outs += [o for o in e.step() if o.request_id == rid]
    return outs


def ref_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`: (len, V)."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def prompt_of(n: int, vocab: int, seed: int = 5) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_logprobs_equal_the_engines_logits_and_transformers(checkpoint, reference):
    e = engine(checkpoint)
    prompt = prompt_of(9, e.model.config.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=4)
    e.add_request("r", prompt, params)
    outs, seen = [], []
    while e.has_unfinished():
        for o in e.step():
            outs.append(o)
            seen.append(torch.log_softmax(e.last_logits["r"].double(), dim=-1))
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = ref_logprobs(reference, prompt + tokens)
    for i, (o, own) in enumerate(zip(outs, seen, strict=True)):
        assert o.logprobs is not None and len(o.logprobs) == 1
        lp = o.logprobs[0]
        token = o.new_token_ids[0]
        assert lp.logprob == pytest.approx(own[token].item(), abs=1e-5)  # what the engine computed
        assert list(lp.top_ids) == own.topk(4).indices.tolist()
        theirs = ref[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(theirs[token].item(), abs=1e-3)  # the model's log-softmax
        assert lp.top_ids[0] == token  # greedy: the top alternative is the token
        assert list(lp.top_logprobs) == pytest.approx(theirs.topk(4).values.tolist(), abs=1e-3)


@pytest.mark.parametrize("length", [7, 3 * BUDGET + 5])  # one step, and chunked prefill
def test_prompt_logprobs_equal_transformers_log_likelihoods(checkpoint, reference, length):
    e = engine(checkpoint)
    prompt = prompt_of(length, e.model.config.vocab_size, seed=length)
    outs = run(e, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True))
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    got = outs[0].prompt_logprobs
    assert len(got) == length - 1  # positions 1..P-1; the first prompt token has none
    ref = ref_logprobs(reference, prompt)
    for j, lp in enumerate(got):
        assert lp.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=1e-3)
        assert list(lp.top_ids) == ref[j].topk(2).indices.tolist()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(checkpoint, reference):
    e = engine(checkpoint)
    prompt = prompt_of(BUDGET + 4, e.model.config.vocab_size, seed=9)
    outs = run(e, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(outs) == 1
    out = outs[0]
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert out.new_token_ids == [] and out.num_output_tokens == 0
    assert out.prompt_logprobs is not None
    ref = ref_logprobs(reference, prompt)
    total = sum(lp.logprob for lp in out.prompt_logprobs)
    assert total == pytest.approx(sum(ref[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)), abs=1e-2)
    assert not e.requests


PENALTIES = [
    {"presence_penalty": 2.0},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"min_p": 0.2, "temperature": 1.0, "seed": 3},
    {"logit_bias": ((5, 8.0), (6, 7.5))},
]
_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": ()}


@pytest.mark.slow  # three engines per penalty, ~30 s in all on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize("extra", PENALTIES, ids=lambda d: "-".join(d))
def test_penalised_tokens_are_the_same_after_a_kv_hand_off(checkpoint, extra):
    """One engine runs the request; then engine A prefills it (one token, KV held), exports the KV and engine B
    continues it: the counts come from the request's own tokens, so the tokens are the same."""
    prompt = prompt_of(11, 1 << 30, seed=2)
    base = {"max_tokens": 20, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    params = SamplingParams(**{**base, **extra})
    a, b = engine(checkpoint), engine(checkpoint)
    prompt = [t % a.model.config.vocab_size for t in prompt]
    whole = [t for o in run(engine(checkpoint), prompt, params) for t in o.new_token_ids]
    a.add_request("r", prompt, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    first = [t for o in iter_steps(a) for t in o.new_token_ids]
    b.import_kv("r", prompt, first, params, a.export_kv("r"))
    rest = [t for o in iter_steps(b) for t in o.new_token_ids]
    assert first + rest == whole
    off = {k: v for k, v in _OFF.items() if k in extra}
    plain = [t for o in run(engine(checkpoint), prompt, dataclasses.replace(params, **off)) for t in o.new_token_ids]
    assert plain != whole  # the parameter changed the tokens (so the comparison above can fail)


def iter_steps(e: Engine) -> list[RequestOutput]:
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return outs


@pytest.mark.parametrize("extra", PENALTIES, ids=lambda d: "-".join(d))
def test_penalised_tokens_are_the_same_after_a_migration(checkpoint, extra):
    """A request moved to another engine after k tokens (prompt + those tokens recomputed there, as the gateway
    re-dispatches it) continues with the tokens one engine gives."""
    prompt = [t % 251 for t in prompt_of(11, 1 << 30, seed=2)]
    params = SamplingParams(**{"max_tokens": 20, "temperature": 0.0, "ignore_eos": True, **extra})
    whole = [t for o in run(engine(checkpoint), prompt, params) for t in o.new_token_ids]
    moved = engine(checkpoint)
    moved.add_request("m", prompt, params, output_token_ids=whole[:13])
    assert whole[:13] + [t for o in iter_steps(moved) for t in o.new_token_ids] == whole


def test_logprobs_of_a_constrained_request_come_from_the_masked_distribution(checkpoint):
    """With a grammar (structured output) the mask applies before sampling, so the logprobs are those of the
    allowed tokens: every top alternative is one the grammar allows, and they sum to at most 1."""
    e = engine(checkpoint)
    choices = ["alpha", "beta"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, structured=specs.choice(choices))
    outs = run(e, prompt_of(6, e.model.config.vocab_size), params)
    tokens = [t for o in outs for t in o.new_token_ids]
    first = outs[0].logprobs
    assert first is not None
    lp = first[0]
    allowed = [lp.top_logprobs[i] for i, _ in enumerate(lp.top_ids) if lp.top_logprobs[i] > -9999.0]
    assert 1 <= len(allowed) <= 2  # the first character of one of the two choices
    assert sum(math.exp(v) for v in allowed) == pytest.approx(1.0, abs=1e-4)
    assert lp.top_ids[0] == tokens[0]


def test_each_of_n_choices_has_the_logprobs_of_its_single_request_and_the_prompts(checkpoint):
    """n > 1: the forked choices' first tokens carry logprobs (penalties counted over the shared prompt) and the
    prompt's logprobs, equal to what each choice's single request reports."""
    from shared.engine.fork import Choice, choice_params

    base = SamplingParams(
        max_tokens=4, temperature=0.9, seed=3, logprobs=3, prompt_logprobs=1, repetition_penalty=1.3, ignore_eos=True
    )
    e = engine(checkpoint)
    prompt = prompt_of(11, e.model.config.vocab_size)
    e.add_group(prompt, [Choice(f"c{i}", choice_params(base, i)) for i in range(3)])
    group: dict[str, list[RequestOutput]] = {}
    while e.has_unfinished():
        for o in e.step():
            group.setdefault(o.request_id, []).append(o)
    e.check_integrity()
    for i in range(3):
        single = run(engine(checkpoint), prompt, choice_params(base, i), rid="s")
        got = group[f"c{i}"]
        assert [o.new_token_ids for o in got] == [o.new_token_ids for o in single], f"choice {i}"
        for mine, theirs in zip(got, single, strict=True):
            assert mine.logprobs is not None and theirs.logprobs is not None
            for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
                assert a.top_ids == b.top_ids and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert got[0].prompt_logprobs and single[0].prompt_logprobs
        assert [lp.logprob for lp in got[0].prompt_logprobs] == pytest.approx(
            [lp.logprob for lp in single[0].prompt_logprobs], abs=1e-4
        )
