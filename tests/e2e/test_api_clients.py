"""The API as real clients see it, against a real stack (nats, redis, gateway, a prefill and a decode worker):
every response and stream chunk of chat, completions and models validates against OpenAI's published schemas
(tests/openai_schema.py); the official `openai` SDK parses each, streaming and not, into the same text the raw
HTTP answer has; a refused field reaches the SDK as a 400 naming it; /tokenize counts what usage counts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.openai_schema import validate, validate_error, validate_stream_chunk

MODEL = "demo"
USER = [{"role": "user", "content": "Tell me about disaggregated serving"}]
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(stack):
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    payloads = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


SCHEMA = {True: "CreateChatCompletionResponse", False: "CreateCompletionResponse"}


def _text(choice: dict, chat: bool) -> str:
    return choice["delta"].get("content") or "" if chat else choice["text"]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_live_responses_validate(http, chat):
    path, name = ("/v1/chat/completions" if chat else "/v1/completions"), SCHEMA[chat]
    body = {"model": MODEL, **GREEDY, **({"messages": USER} if chat else {"prompt": PROMPT})}
    whole = http.post(path, json=body)
    assert whole.status_code == 200, whole.text
    validate(whole.json(), name)
    for usage in (False, True):
        chunks = _events(http, path, body | {"stream_options": {"include_usage": usage}})
        assert len(chunks) >= GREEDY["max_tokens"]
        for chunk in chunks:
            validate_stream_chunk(chunk, chat=chat)
        assert ("usage" in chunks[-1]) is usage
        text = "".join(_text(c["choices"][0], chat) for c in chunks if c["choices"])
        answer = whole.json()["choices"][0]
        assert text == (answer["message"]["content"] if chat else answer["text"])


def test_live_models_and_errors_validate(http):
    validate(http.get("/v1/models").json(), "ListModelsResponse")
    validate(http.get(f"/v1/models/{MODEL}").json(), "Model")
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    validate_error(missing.json())
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "suffix": "!"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"
    validate_error(refused.json())


def test_openai_sdk_chat(sdk, http):
    raw = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **GREEDY}).json()
    chat = sdk.chat.completions.create(model=MODEL, messages=USER, **GREEDY)
    assert chat.choices[0].message.content == raw["choices"][0]["message"]["content"]
    assert chat.choices[0].message.refusal is None and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == GREEDY["max_tokens"]
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == chat.usage


def test_openai_sdk_completions(sdk, http):
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **GREEDY}).json()
    done = sdk.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert done.choices[0].text == raw["choices"][0]["text"] and done.choices[0].finish_reason == "length"
    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_sdk_models(sdk, model_dir):
    (card,) = sdk.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_openai_sdk_sees_a_refused_field(sdk):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=USER, store=True, **GREEDY)
    assert refused.value.status_code == 400 and refused.value.param == "store"
    # its "off" value and a field OpenAI does not define are served
    ok = sdk.chat.completions.create(model=MODEL, messages=USER, store=False, extra_body={"x_bench": 1}, **GREEDY)
    assert ok.choices[0].message.content


def test_tokenize_counts_what_usage_counts(http):
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **GREEDY}).json()
    counted = http.post("/tokenize", json={"model": MODEL, "messages": USER}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] and counted["max_model_len"] > counted["count"]
    text = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **GREEDY}).json()
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert len(tokens) == text["usage"]["prompt_tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": PROMPT}
