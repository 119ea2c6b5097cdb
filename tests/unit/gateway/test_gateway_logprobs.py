"""Logprobs, echo and the new sampling fields through the gateway (the in-process fake backend sends logprobs as a
worker does): the job's Sampling carries what the request asked, the responses carry the logprobs the updates
brought, in chat's and the legacy completions' shapes, whole and streamed."""

from __future__ import annotations

import json

from tests.openai_schema import errors, validate, validate_stream_chunk
from tests.unit.gateway.harness import (
    CHAT,
    COMPLETIONS,
    USER,
    fake_logprob,
    stream_chunks,
)


def test_sampling_fields_reach_the_job(client, fake):
    body = {
        "messages": USER,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.3,
        "min_p": 0.1,
        "logit_bias": {"7": 3.5, "12": -100},
        "logprobs": True,
        "top_logprobs": 3,
    }
    assert client.post(CHAT, json=body).status_code == 200
    s = fake.jobs[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.3, 0.1)
    assert s.logit_bias == {7: 3.5, 12: -100.0}
    assert (s.logprobs, s.prompt_logprobs) == (3, None)


def test_chat_logprobs_whole_and_streamed(client, fake, tokenizer):  # noqa: F811
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2, "max_tokens": 6}
    whole = client.post(CHAT, json=body).json()["choices"][0]
    ids = fake.reply_ids()[:6]
    content = whole["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [fake_logprob(t, 2).logprob for t in ids]
    raw = b"".join(bytes(c["bytes"]) for c in content)
    assert raw == tokenizer.decode(ids).encode()  # the bytes of split characters join up to the text
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [[-0.25, -1.25]] * 6
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]
    streamed = stream_chunks(client.post(CHAT, json=body | {"stream": True}).text)
    parts = [e for c in streamed for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content") or []]
    assert parts == content
    plain = client.post(CHAT, json={"messages": USER}).json()["choices"][0]
    assert plain["logprobs"] is None


def test_completion_echo_with_logprobs_puts_the_prompt_first(client, fake, tokenizer):  # noqa: F811
    prompt = "abc de"
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3}
    resp = client.post(COMPLETIONS, json=body).json()
    choice = resp["choices"][0]
    reply = fake.reply_ids()[:3]
    assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode(reply)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-0.25] * (len(ids) - 1 + 3)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert fake.jobs[-1].sampling.prompt_logprobs == 1 and fake.jobs[-1].sampling.logprobs == 1
    streamed = stream_chunks(client.post(COMPLETIONS, json=body | {"stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == choice["text"]
    tokens = [t for c in streamed if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]


def test_max_tokens_zero_with_echo_scores_only(client, fake, tokenizer):  # noqa: F811
    body = {"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 0, "max_tokens": 0}
    resp = client.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == tokenizer.decode([5, 6, 7, 8]) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -0.25, -0.25]
    assert resp.json()["usage"]["completion_tokens"] == 0
    assert fake.jobs[-1].sampling.max_tokens == 0


def test_echo_without_logprobs_returns_the_prompt_text(client, fake):
    choice = client.post(COMPLETIONS, json={"prompt": "xyz", "echo": True, "max_tokens": 2}).json()["choices"][0]
    assert choice["text"].startswith("xyz") and choice["logprobs"] is None
    assert json.dumps(choice)  # plain JSON


def test_logprobs_responses_validate_against_openais_schemas(client):
    chat = {"messages": USER, "logprobs": True, "top_logprobs": 2, "max_tokens": 5}
    validate(client.post(CHAT, json=chat).json(), "CreateChatCompletionResponse")
    for chunk in stream_chunks(client.post(CHAT, json=chat | {"stream": True}).text):
        validate_stream_chunk(chunk, chat=True)
    text = {"prompt": "abc", "logprobs": 2, "max_tokens": 5}
    validate(client.post(COMPLETIONS, json=text).json(), "CreateCompletionResponse")
    for chunk in stream_chunks(client.post(COMPLETIONS, json=text | {"stream": True}).text):
        validate_stream_chunk(chunk, chat=False)
    # echo's first prompt token has null logprobs (as OpenAI's legacy API and vLLM answer): the one deviation
    echoed = client.post(COMPLETIONS, json=text | {"echo": True}).json()
    assert errors(echoed, "CreateCompletionResponse")
    legacy = echoed["choices"][0]["logprobs"]
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    legacy["token_logprobs"][0], legacy["top_logprobs"][0] = 0.0, {}
    validate(echoed, "CreateCompletionResponse")  # the nulls were all that differed


def test_each_of_n_choices_echoes_the_prompt_with_its_own_offsets(client, fake, tokenizer):  # noqa: F811
    """n > 1 with echo and logprobs: every choice's text and logprobs start with the prompt (its first token's
    logprob null), and each choice's text offsets count from its own start, whole and streamed."""
    prompt = "abc de"
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "n": 2, "seed": 1}
    whole = client.post(COMPLETIONS, json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    for c in whole["choices"]:
        assert c["text"].startswith(tokenizer.decode(ids))
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 3
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    streamed = stream_chunks(client.post(COMPLETIONS, json=body | {"stream": True}).text)
    for i, c in enumerate(whole["choices"]):
        mine = [ch["choices"][0] for ch in streamed if ch["choices"] and ch["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == c["text"]
        assert [t for m in mine for t in m["logprobs"]["tokens"]] == c["logprobs"]["tokens"]
        assert [o for m in mine for o in m["logprobs"]["text_offset"]] == c["logprobs"]["text_offset"]
