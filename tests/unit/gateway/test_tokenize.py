"""/tokenize and /detokenize (vLLM's shapes): the counts are what a completion would send the model, chat
tokens are exactly the chat route's prompt, the two round-trip, bad input is a 400 naming the field, another
model a 404, and with API keys they need one; the served OpenAPI document lists both."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from services.gateway import create_app
from tests.unit.gateway.harness import MODEL, assert_error, settings_for

TEXT = "héllo 世界, tokenize me"
USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]


def test_tokenize_prompt_counts_what_a_completion_sends(client, fake, tokenizer):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048  # the demo checkpoint's context
    assert client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).status_code == 200
    assert fake.jobs[-1].prompt_token_ids == body["tokens"]
    strs = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()["token_strs"]
    assert strs == [tokenizer.id_to_token(t) for t in body["tokens"]]


@pytest.mark.parametrize("add_generation_prompt", [None, True, False])
def test_tokenize_messages_is_the_chat_prompt(client, fake, add_generation_prompt):
    extra = {} if add_generation_prompt is None else {"add_generation_prompt": add_generation_prompt}
    body = client.post("/tokenize", json={"messages": USER, **extra}).json()
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    assert body["tokens"] == fake.jobs[-1].prompt_token_ids and body["count"] == len(body["tokens"])
    assert r.json()["usage"]["prompt_tokens"] == body["count"]


def test_generation_prompt_makes_a_difference(client):
    on = client.post("/tokenize", json={"messages": USER}).json()["count"]
    off = client.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()["count"]
    assert on > off


def test_add_special_tokens(client, tokenizer):
    plain = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert plain == tokenizer.encode(TEXT, add_special_tokens=False)


def test_detokenize_round_trips(client, tokenizer):
    tokens = client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    r = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    chat = client.post("/tokenize", json={"messages": USER}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": chat}).json()["prompt"]
    assert TEXT in text and text == tokenizer.decode(chat, skip_special_tokens=False)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": USER, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param)


def test_another_model_is_a_404(client):
    assert_error(client.post("/tokenize", json={"model": "other", "prompt": "a"}), 404, "model")
    assert_error(client.post("/detokenize", json={"model": "other", "tokens": [1]}), 404, "model")


def test_api_keys_guard_them(checkpoint, fake):
    with TestClient(create_app(settings_for(checkpoint, api_keys=("k1",)), fake)) as c:
        assert_error(c.post("/tokenize", json={"prompt": "a"}), 401, None)
        assert_error(c.post("/detokenize", json={"tokens": [1]}), 401, None)
        ok = c.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200, ok.text
        assert c.get("/health").status_code == 200


def test_openapi_document_lists_them(client):
    doc = client.get("/schema/openapi.json").json()
    for path, response in (("/tokenize", "TokenizeResponse"), ("/detokenize", "DetokenizeResponse")):
        op = doc["paths"][path]["post"]
        assert {"200", "400", "404"} <= set(op["responses"])
        assert response in str(op["responses"]["200"])
    props = doc["components"]["schemas"]["TokenizeRequest"]["properties"]
    assert {"prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"} <= set(props)
