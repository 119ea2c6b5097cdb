"""Penalties, filters, logprobs and echo through a disaggregated stack (prefill worker → KV hand-off → decode
worker), with the official openai client, against the single-process engine and transformers on the same
checkpoint."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import start_stack

PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_dir(model_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# (API fields, the engine's SamplingParams fields): each changes the greedy tokens of PROMPT on the demo model
PENALTIES = [
    ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"logit_bias": {"5": 9.0, "70": 8.0}}, {"logit_bias": ((5, 9.0), (70, 8.0))}),
    ({"min_p": 0.3, "temperature": 1.0, "seed": 11}, {"min_p": 0.3, "temperature": 1.0, "seed": 11}),
]


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize(("api", "ours"), PENALTIES, ids=lambda v: "-".join(v) if isinstance(v, dict) else "")
def test_each_penalty_gives_the_engines_tokens_through_the_hand_off(client, engine, model_dir, api, ours):
    tok = Tokenizer(model_dir)
    ids = tok.encode(PROMPT)
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} | ours
    want = engine.generate([ids], SamplingParams(**params))[0]
    plain = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    if "seed" not in ours:
        assert want != plain  # the parameter matters here, so equality below can fail
    body = {"temperature": 0} | api
    extra = {k: body.pop(k) for k in ("repetition_penalty", "min_p") if k in body}
    done = client.completions.create(
        model="demo", prompt=ids, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, **extra}, **body
    )
    assert done.choices[0].text == tok.decode(want)
    streamed = client.completions.create(
        model="demo", prompt=ids, max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True, **extra}, **body
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == tok.decode(want)


def test_chat_logprobs_streaming_and_not_equal_the_engines(client, engine, model_dir):
    tok = Tokenizer(model_dir)
    messages = [{"role": "user", "content": "hello there"}]
    ids = tok.encode_chat(messages)
    engine.add_request("lp", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))
    want = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.logprobs is not None
            want += [(t, lp) for t, lp in zip(o.new_token_ids, o.logprobs, strict=True)]
    kwargs = dict(model="demo", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    done = client.chat.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    content = done.choices[0].logprobs.content
    assert len(content) == len(want)
    for entry, (token, lp) in zip(content, want, strict=True):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert entry.token == tok.decode([token], skip_special_tokens=False)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(lp.top_logprobs), abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the token is the top one
    stream = client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **kwargs)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_scores_the_prompt_as_transformers_does(client, reference, model_dir):
    tok = Tokenizer(model_dir)
    ids = tok.encode(PROMPT)
    done = client.completions.create(model="demo", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = done.choices[0]
    assert choice.text == tok.decode(ids) and done.usage.completion_tokens == 0
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)
    for j in range(1, len(ids)):
        assert lps[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-3)
    # with a completion after the prompt (and streamed): the prompt's part is the same
    streamed = client.completions.create(
        model="demo", prompt=ids, max_tokens=3, echo=True, logprobs=2, temperature=0, stream=True
    )
    scored = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert len(scored) == len(ids) + 3
    assert scored[1 : len(ids)] == pytest.approx(lps[1:], abs=1e-6)
    assert all(v is not None and math.isfinite(v) for v in scored[1:])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logprobs": 9}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
    ],
)
def test_bad_values_are_400s_naming_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="demo", prompt="hi", **({"max_tokens": 2} | kwargs))
    assert excinfo.value.body["param"] == param  # type: ignore[index]


def test_a_mixed_worker_scores_and_penalises_as_one_engine(model_dir, engine, reference):
    """The colocated role: the same prompt logprobs (max_tokens 0 ends in the one engine) and penalised tokens."""
    tok = Tokenizer(model_dir)
    ids = tok.encode(PROMPT)
    spec = StackSpec(model=str(model_dir), port=free_port(), mixed=1, prefill=0, decode=0, threads_per_worker=1)
    stack = start_stack(spec)
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
        scored = client.completions.create(model="demo", prompt=ids, max_tokens=0, echo=True, logprobs=0)
        penalised = client.completions.create(
            model="demo", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, frequency_penalty=1.5,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
        )  # fmt: skip
    finally:
        stack.stop()
    lps = scored.choices[0].logprobs.token_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)
    assert lps[0] is None
    assert lps[1:] == pytest.approx([ref[j - 1, ids[j]].item() for j in range(1, len(ids))], abs=1e-3)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3
    )
    assert penalised.choices[0].text == tok.decode(engine.generate([ids], params)[0])
