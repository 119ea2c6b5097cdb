"""Every response and stream chunk of chat, completions and models, as the gateway writes them (in-process fake
backend), validates against OpenAI's published component schemas (tests/openai_schema.py); and the validator
itself rejects what OpenAI's schema rejects, so a pass means something."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jsonschema
import pytest

from services.gateway.backend import Update
from tests.openai_schema import SCHEMAS, errors, validate, validate_error, validate_stream_chunk
from tests.unit.gateway.harness import CHAT, COMPLETIONS, MODEL, USER, stream_chunks


@pytest.mark.parametrize("max_tokens", [3, None])  # finish "length" and "stop"
def test_chat_completion_validates(client, max_tokens):
    r = client.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    body = r.json()
    validate(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["refusal"] is None


@pytest.mark.parametrize("max_tokens", [3, None])
def test_completion_validates(client, max_tokens):
    r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    validate(r.json(), "CreateCompletionResponse")


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("usage", [True, False])
def test_stream_chunks_validate(client, chat, usage):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": usage}}
    body |= {"messages": USER} if chat else {"prompt": "hi", "max_tokens": 40}
    r = client.post(CHAT if chat else COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    chunks = stream_chunks(r.text)
    assert len(chunks) > 2
    for chunk in chunks:
        validate_stream_chunk(chunk, chat=chat)
    assert ("usage" in chunks[-1]) is usage


def test_models_validate(client):
    listed = client.get("/v1/models").json()
    validate(listed, "ListModelsResponse")
    validate(client.get(f"/v1/models/{MODEL}").json(), "Model")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": USER, "store": True}),  # a refused field: param set
        (CHAT, {"messages": []}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": "2"}),
        (COMPLETIONS, {"model": "other", "prompt": "hi"}),  # 404
        ("/v1/no-such-route", {}),
    ],
)
def test_error_bodies_validate_but_for_the_integer_code(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code >= 400
    validate_error(r.json())
    assert any("code" in e for e in errors(r.json(), "ErrorResponse"))  # the integer, and only that


@pytest.mark.parametrize("chat", [True, False])
def test_a_mid_stream_error_event_validates(client, fake, chat):
    fake.fail, fake.fail_after = Update([], "error", "decode worker lost"), 3
    body = {"model": MODEL, "stream": True, **({"messages": USER} if chat else {"prompt": "hi"})}
    chunks = stream_chunks(client.post(CHAT if chat else COMPLETIONS, json=body).text)
    *tokens, failure = chunks
    assert len(tokens) == 3
    for chunk in tokens:
        validate_stream_chunk(chunk, chat=chat)
    validate_error(failure)


def test_the_validator_rejects_what_openai_rejects(client):
    """Guards the guard: the shapes this branch fixed fail without the fix, and a wrong type fails."""
    body = client.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2}).json()
    del body["choices"][0]["message"]["refusal"]
    assert any("refusal" in e for e in errors(body, "CreateChatCompletionResponse"))
    chunk = client.post(CHAT, json={"model": MODEL, "messages": USER, "stream": True}).text
    first = stream_chunks(chunk)[0]
    first["object"] = "chat.completion"
    with pytest.raises(jsonschema.ValidationError, match="object"):
        validate_stream_chunk(first, chat=True)
    text = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "stream": True}).text
    mid = stream_chunks(text)[0]
    assert mid["choices"][0]["finish_reason"] is None  # the kept deviation, accepted by validate_stream_chunk...
    assert errors(mid, "CreateCompletionResponse")  # ...and not by the bare schema
    with pytest.raises(KeyError):
        validate({}, "NoSuchSchema")


def test_schemas_json_is_what_extract_makes():
    """The checked-in schemas are the published document's, unedited: extract.py run again on the pinned commit
    gives the same file (where a local copy of openai-openapi exists; tests never download it)."""
    script = SCHEMAS.with_name("extract.py")
    spec = importlib.util.spec_from_file_location("openai_openapi_extract", script)
    assert spec is not None and spec.loader is not None
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    if not Path(os.environ.get("OPENAI_OPENAPI_REPO", extract.DEFAULT_REPO)).exists():
        pytest.skip("no local copy of github.com/openai/openai-openapi")
    assert extract.extract(extract._load([])) == json.loads(SCHEMAS.read_text())
