"""Every request field of OpenAI's CreateChatCompletionRequest / CreateCompletionRequest has one status in
pdserve (supported, refused with a 400 naming it, or accepted as bookkeeping),
docs/api.md states the same status for each, and a refused field is a 400 naming it while its "off" values and
fields OpenAI does not define are accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.gateway import create_app
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.unsupported import BOOKKEEPING, REFUSED
from tests.openai_schema import SCHEMAS
from tests.unit.gateway.harness import MODEL, FakeBackend, assert_error, settings_for

ROOT = Path(__file__).resolve().parents[3]
APIS = {
    "chat": (ChatCompletionRequest, "CreateChatCompletionRequest"),
    "completions": (CompletionRequest, "CreateCompletionRequest"),
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completions": {"prompt": "hi"}}


def openai_fields(name: str) -> set[str]:
    defs = json.loads(SCHEMAS.read_text())["$defs"]

    def props(schema: dict) -> set[str]:
        found = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            found |= props(defs[part["$ref"].split("/")[-1]]) if "$ref" in part else props(part)
        return found

    return props(defs[name])


def statuses(api: str) -> dict[str, str]:
    """pdserve's status of each OpenAI field, from the code: what the request struct decodes is supported."""
    kind, name = APIS[api]
    out = {}
    for field in openai_fields(name):
        if field in BOOKKEEPING[kind]:
            out[field] = "bookkeeping"
        elif field in REFUSED[kind]:
            out[field] = "refused"
        elif field in kind.__struct_fields__:
            out[field] = "supported"
        else:
            out[field] = "UNACCOUNTED"
    return out


@pytest.mark.parametrize("api", APIS)
def test_every_openai_field_has_a_status(api):
    kind, name = APIS[api]
    found = statuses(api)
    assert len(found) > 10
    assert [f for f, s in found.items() if s == "UNACCOUNTED"] == []
    # and the tables name only fields OpenAI defines (a typo would refuse nothing)
    listed = {f.split(".", 1)[0] for f in [*REFUSED[kind], *BOOKKEEPING[kind]]}
    assert listed <= openai_fields(name)


def documented(api: str) -> dict[str, str]:
    """The status column of docs/api.md's table of `api`'s request fields."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split(f"<!-- fields:{api} -->", 1)[1].split("<!-- /fields -->", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \| ([a-z ]+?) \|", section, re.M)
    return dict(rows)


@pytest.mark.parametrize("api", APIS)
def test_docs_state_each_fields_status(api):
    kind, _ = APIS[api]
    docs = documented(api)
    expected = statuses(api) | {f: "refused" for f in REFUSED[kind] if "." in f}
    assert docs == expected


@pytest.fixture(scope="module")
def app(checkpoint, tokenizer):  # one app for the module's many requests (building one takes ~0.5 s)
    return create_app(settings_for(checkpoint), FakeBackend(tokenizer))


def _with(api: str, field: str, value) -> dict:
    top, _, nested = field.partition(".")
    return {"model": MODEL, "max_tokens": 2, **BASE[api], top: {nested: value} if nested else value}


REFUSALS = [(api, field, rule) for api, (kind, _) in APIS.items() for field, rule in REFUSED[kind].items()]


@pytest.mark.parametrize(("api", "field", "rule"), REFUSALS, ids=[f"{a}-{f}" for a, f, _ in REFUSALS])
def test_refused_field_is_a_400_naming_it(client, api, field, rule):
    r = client.post(PATHS[api], json=_with(api, field, {"any": "value"}))
    error = assert_error(r, 400, field)
    assert field in error["message"]
    for off in (None, *rule.off):
        r = client.post(PATHS[api], json=_with(api, field, off))
        assert r.status_code == 200, (off, r.text)


def test_refusals_look_at_types_not_truthiness(client):
    assert_error(client.post(PATHS["chat"], json=_with("chat", "store", 0)), 400, "store")
    assert_error(client.post(PATHS["chat"], json=_with("chat", "modalities", ["text", "audio"])), 400, "modalities")
    assert_error(client.post(PATHS["completions"], json=_with("completions", "suffix", " end")), 400, "suffix")


def test_bookkeeping_and_unknown_fields_are_accepted(client):
    extras = {"metadata": {"k": "v"}, "safety_identifier": "u1", "prompt_cache_key": "p", "user": "me"}
    extras |= {"some_benchmark_extra": {"x": 1}, "min_tokens": 1}
    assert client.post(PATHS["chat"], json=_with("chat", "service_tier", "auto") | extras).status_code == 200
    assert client.post(PATHS["completions"], json=_with("completions", "user", "me") | extras).status_code == 200


def test_a_strict_type_error_comes_before_a_refusal(client):
    body = _with("chat", "audio", {"voice": "x"}) | {"max_tokens": "2"}
    assert_error(client.post(PATHS["chat"], json=body), 400, "max_tokens")


@pytest.mark.parametrize("api", APIS)
def test_openapi_document_states_refused_and_bookkeeping_fields(client, api):
    kind, _ = APIS[api]
    schemas = client.get("/schema/openapi.json").json()["components"]["schemas"]
    properties = schemas[kind.__name__]["properties"]
    for field, rule in REFUSED[kind].items():
        top, _, nested = field.partition(".")
        schema = schemas["StreamOptions"]["properties"][nested] if nested else properties[top]
        assert schema["enum"] == [None, *rule.off] and "Not supported" in schema["description"], field
    for field in BOOKKEEPING[kind]:
        assert field in properties
