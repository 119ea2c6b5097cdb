"""The gateway fuzzed from its own OpenAPI document (schemathesis), in process over ASGI.

Every operation of /schema/openapi.json gets schema-valid (positive) data and, where it takes input,
schema-violating (negative) data: a bounded number of cases, derandomized (the same cases on every run).
For each response: no 5xx, the status code and content type are documented, the body conforms to the
documented schema (errors in the OpenAI shape), schema-violating data is refused with a 4xx, an event stream
is well framed. The backend is the fake of test_gateway.py that also does what a worker does with a job: the
job goes through its wire form, and one a worker would refuse (shared/job_checks.py) ends in that worker's
error, as it would in a real stack.

Below the fuzzing: one plain regression test for each bug it found, in the document or in the gateway.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import NamedTuple

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from litestar.testing import TestClient
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

from services.gateway import create_app
from services.gateway.backend import GenerationJob, Overloaded, Update
from services.gateway.draining import Drain
from services.gateway.prepare import CHAT_ROLES
from services.gateway.schemas import API_KEY_SCHEME, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from services.gateway.schemas import CHAT_ROLES as DOCUMENTED_ROLES
from services.gateway.served_model import ServedModel
from shared.job_checks import job_refusal
from shared.messages import PrefillJob, decode, encode, token_subject
from shared.model.tokenizer import Tokenizer
from shared.worker import sampling_params
from tests.unit.gateway.harness import MODEL, FakeBackend, FakeStream, settings_for

EXAMPLES = 100  # per operation and generation mode: the whole file runs in well under a minute
NEGATIVE_STATUSES = {400, 404, 413, 415}  # how schema-violating data is refused
SEED = 20240611


class WorkerLikeBackend(FakeBackend):
    """FakeBackend, plus what a worker does with the job before running it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        super().__init__(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.refused: list[str] = []

    async def open(self, job: GenerationJob) -> FakeStream:
        wire = PrefillJob(job.request_id, job.model, job.prompt_token_ids, job.sampling, token_subject("gw", "r"))
        wire = decode(encode(wire), PrefillJob)  # what a worker receives
        refusal = job_refusal(wire, self.vocab_size, self.max_model_len)
        if refusal is not None:
            self.refused.append(refusal.reason)
            return FakeStream(self, iter([Update(finish_reason="error", error=refusal.reason, status=400)]))
        sampling_params(wire.sampling)  # the engine's own validation: raises (a 500 here) if the job is bad
        return await super().open(job)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return WorkerLikeBackend(tokenizer, vocab_size=259, max_model_len=2048)


@pytest.fixture(scope="module")
def app(checkpoint, backend):  # one app for the module (the schema is read from it): `client` enters it per test
    return create_app(settings_for(checkpoint), backend)


@pytest.fixture(scope="module")
def gateway_schema(app):
    # whole event streams (schemathesis cuts them at 20 events by default), to check how they end
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "generation": {"deterministic": True},
            "max-stream-events": 10_000,
            # a body over the size limit is refused too (413): text over a declared length limit can be
            "checks": {"negative_data_rejection": {"expected-statuses": sorted(NEGATIVE_STATUSES)}},
        }
    )
    return schemathesis.openapi.from_asgi("/schema/openapi.json", app, config=config)


CHECKS = [
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.negative_data_rejection,
]
# every operation of the document: whether it takes input (and so can be sent schema-violating data)
OPERATIONS = {
    ("POST", "/v1/chat/completions"): True,
    ("POST", "/v1/completions"): True,
    ("GET", "/v1/models"): False,
    ("GET", "/v1/models/{model_id}"): False,  # any string is a valid model id: nothing violates the schema
    ("GET", "/health"): False,
    ("GET", "/ready"): False,
    ("POST", "/tokenize"): True,
    ("POST", "/detokenize"): True,
}


def _keyed(path: str) -> bool:
    """Whether the API keys guard `path`: /v1, and vLLM's tokenizer routes beside it."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


CASES = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [
    (op, GenerationMode.NEGATIVE) for op, takes_input in OPERATIONS.items() if takes_input
]


def _as_clients_send(case):
    """Valid cases as clients write them: naming the served model (a random name is a 404, and would end most
    cases there), integers without a fraction (JSON Schema counts 2.0 as an integer; the gateway decodes
    strictly and refuses it, as documented in schemas.py)."""
    if isinstance(case.body, dict):
        case.body = _integral(case.body)
        if case.body.get("model") is not None:
            case.body["model"] = MODEL
    return case


def _integral(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _check_event_stream(text: str) -> None:
    events = [e for e in text.split("\n\n") if e]
    assert events and all(e.startswith("data: ") for e in events), text[:500]
    assert events[-1] == "data: [DONE]", text[-500:]


def test_every_operation_is_fuzzed(gateway_schema):
    documented = {(op.method.upper(), op.path) for op in (r.ok() for r in gateway_schema.get_all_operations())}
    assert documented == set(OPERATIONS)


@pytest.mark.slow  # schema fuzzing of every operation, ~45 s on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize(("operation", "mode"), CASES, ids=lambda x: " ".join(x) if isinstance(x, tuple) else x.value)
def test_fuzz(gateway_schema, operation, mode):
    method, path = operation
    strategy = gateway_schema[path][method].as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(_as_clients_send)
    statuses: collections.Counter[int] = collections.Counter()

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case):
        response = case.call()
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r}: {response.text}"
        case.validate_response(response, checks=CHECKS)
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            _check_event_stream(response.text)

    fuzz()
    print(f"{method} {path} {mode.value}: statuses {sorted(statuses.items())}")
    assert sum(statuses.values()) > 0
    if mode is GenerationMode.NEGATIVE:
        assert set(statuses) <= NEGATIVE_STATUSES


def test_fuzz_without_the_api_key(checkpoint, backend):
    """With API keys set, every /v1 operation (and /tokenize, /detokenize) answers anything without a key with a
    documented 401."""
    app = create_app(settings_for(checkpoint, api_keys=("sk-fuzz",)), backend)
    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    for method, path in [op for op in OPERATIONS if _keyed(op[1])]:

        @given(case=schema[path][method].as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(
            max_examples=10, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
        )
        def fuzz(case):
            response = case.call()
            statuses[(case.path, response.status_code)] += 1
            case.validate_response(response, checks=CHECKS)

        fuzz()
    assert {status for _, status in statuses} == {401}, statuses
    assert len({path for path, _ in statuses}) == 6


def test_fuzz_with_the_api_key(checkpoint, backend):
    """With API keys set and schemathesis given one for the declared bearer scheme, every /v1 operation serves
    the key's requests, and the same requests without a key or with a wrong one are refused (ignored_auth)."""
    key = "sk-fuzz-with-a-key"
    app = create_app(settings_for(checkpoint, api_keys=(key,)), backend)
    config = schemathesis.Config.from_dict({"auth": {"openapi": {API_KEY_SCHEME: {"bearer": key}}}})
    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app, config=config)
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    for method, path in [op for op in OPERATIONS if _keyed(op[1])]:

        @given(case=schema[path][method].as_strategy(generation_mode=GenerationMode.POSITIVE).map(_as_clients_send))
        @settings(
            max_examples=10, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
        )
        def fuzz(case):
            response = case.call()
            statuses[(case.path, response.status_code)] += 1
            case.validate_response(response, checks=[*CHECKS, openapi_checks.ignored_auth])

        fuzz()
    assert 401 not in {status for _, status in statuses}, statuses
    served = {path for path, status in statuses if status == 200}  # ignored_auth probes only what was served
    assert served >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}, statuses


# ---- regressions: one per bug the fuzzing found ----------------------------------------------------------


def test_deeply_nested_json_is_a_400_not_a_500(client):
    """msgspec raises RecursionError (not a DecodeError) past its nesting limit: it was a 500."""
    body = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"] == "the request body nests arrays or objects too deeply"


def _document(client) -> dict:
    return client.get("/schema/openapi.json").json()


def test_errors_are_documented_in_the_openai_shape(client):
    """The document said 400 was litestar's {status_code, detail, extra} and left out 404 / 413 / 415 / 429 /
    503 (and /ready's 503): every error status a route answers is now declared, with the shape it has."""
    paths = _document(client)["paths"]
    error = {"$ref": "#/components/schemas/ErrorBody"}
    expected = {
        ("/v1/chat/completions", "post"): {"400", "401", "404", "413", "415", "429", "500", "503", "504"},
        ("/v1/completions", "post"): {"400", "401", "404", "413", "415", "429", "500", "503", "504"},
        ("/v1/models", "get"): {"401"},
        ("/v1/models/{model_id}", "get"): {"400", "401", "404"},
        ("/ready", "get"): {"503"},
    }
    for (path, method), statuses in expected.items():
        responses = paths[path][method]["responses"]
        assert set(responses) - {"200"} == statuses, (path, sorted(responses))
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error, (path, status)


def test_success_bodies_are_documented(client):
    """200 was documented as `{}` for the completion routes and /ready (their handlers return unions); a
    completion's 200 is JSON or, with stream=true, server-sent events."""
    paths = _document(client)["paths"]
    for path, schema in (("/v1/completions", "Completion"), ("/v1/chat/completions", "ChatCompletion")):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{schema}"}
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
    ready = paths["/ready"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ready == {"$ref": "#/components/schemas/Status"}


def test_zero_bounds_are_documented(client):
    """litestar drops a bound of 0 (a truthiness test): temperature's minimum and top_p's exclusive minimum
    were missing, so -1 looked valid."""
    properties = _document(client)["components"]["schemas"]["CompletionRequest"]["properties"]
    assert properties["temperature"]["minimum"] == 0.0
    assert properties["top_p"]["exclusiveMinimum"] == 0.0
    for field, body in (("temperature", {"temperature": -1}), ("top_p", {"top_p": 0})):
        resp = client.post("/v1/completions", json={"prompt": "hi"} | body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_what_prepare_refuses_is_documented(client):
    """Valid-by-the-document requests were refused (n=2, best_of=2, echo, logprobs, an unknown role, an empty
    prompt or message list): the document now says what is accepted."""
    schemas = _document(client)["components"]["schemas"]
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == CHAT_ROLES == set(DOCUMENTED_ROLES)
    completion = schemas["CompletionRequest"]["properties"]
    assert (completion["n"]["minimum"], completion["n"]["maximum"]) == (1, 16)  # maximum: settings.max_n
    assert completion["best_of"]["minimum"] == 1
    assert completion["logprobs"]["maximum"] == 5 and completion["logprobs"]["minimum"] == 0
    assert [f["minLength"] for f in completion["prompt"]["oneOf"] if f["type"] == "string"] == [1]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    for body in (
        {"prompt": "hi", "n": 17},
        {"prompt": "hi", "best_of": 2},
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": ""},
    ):
        assert client.post("/v1/completions", json=body).status_code == 400


def test_a_tiny_temperature_is_sampled_greedily(client, backend):
    """A temperature of 1e-300 passes the gateway's range [0, 2] but failed inside the engine's sampler (NaN
    probabilities, on the engine thread: a 500, then a worker's refusal): below 1e-5 the engine now samples
    greedily, as vLLM does, and the client gets its completion."""
    refused = len(backend.refused)
    resp = client.post("/v1/completions", json={"prompt": "hi", "temperature": 1e-300})
    assert resp.status_code == 200, resp.text
    assert len(backend.refused) == refused
    assert sampling_params(backend.jobs[-1].sampling).greedy


def test_a_text_part_without_text_is_named_so(client):
    """A `{"type": "text"}` part with no text was refused as "got a 'text' part"."""
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "only text content is supported, got a text part without `text`"


# ---- the document tells the limits, Retry-After, the 503s and the API key -------------------------------


def _request_schema(document: dict, name: str) -> jsonschema_rs.Draft202012Validator:
    return jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _completion(**fields) -> dict:
    return {"prompt": "hi"} | fields


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}]} | fields


def _message(**fields) -> dict:
    return {"messages": [{"role": "user"} | fields]}


def _fixed(n: int) -> Callable[[ServedModel], int]:
    return lambda _: n


def _last_token_id(model: ServedModel) -> int:
    return model.vocab_size - 1


def _prompt_tokens(model: ServedModel) -> int:
    return model.max_prompt_tokens


def _prompt_chars(model: ServedModel) -> int:
    return model.max_prompt_chars


def _generated_tokens(model: ServedModel) -> int:
    return model.max_model_len - 1  # a prompt has at least one token


class Limit(NamedTuple):
    path: str
    param: str  # the field the 400 names
    bound: Callable[[ServedModel], int]
    body: Callable[[int], dict]  # a request with n of what is limited
    served_at_bound: bool = True  # False where a body at the bound may be refused all the same (tokens decide)


LIMITS = {
    "stop strings": Limit(COMPLETIONS, "stop", _fixed(MAX_STOP_STRINGS), lambda n: _completion(stop=["s"] * n)),
    "a stop string": Limit(COMPLETIONS, "stop", _fixed(MAX_STOP_CHARS), lambda n: _completion(stop="s" * n)),
    "a listed stop string": Limit(CHAT, "stop", _fixed(MAX_STOP_CHARS), lambda n: _chat(stop=["x", "s" * n])),
    "stop token ids": Limit(
        CHAT, "stop_token_ids", _fixed(MAX_STOP_TOKEN_IDS), lambda n: _chat(stop_token_ids=[1] * n)
    ),
    "a stop token id": Limit(COMPLETIONS, "stop_token_ids", _last_token_id, lambda n: _completion(stop_token_ids=[n])),
    "prompt tokens": Limit(COMPLETIONS, "prompt", _prompt_tokens, lambda n: {"prompt": [1] * n}),
    "a batch of one's tokens": Limit(COMPLETIONS, "prompt", _prompt_tokens, lambda n: {"prompt": [[1] * n]}),
    "a prompt token id": Limit(COMPLETIONS, "prompt", _last_token_id, lambda n: {"prompt": [1, n]}),
    "prompt text": Limit(COMPLETIONS, "prompt", _prompt_chars, lambda n: {"prompt": "a" * n}, False),
    "max_tokens": Limit(COMPLETIONS, "max_tokens", _generated_tokens, lambda n: {"prompt": [1], "max_tokens": n}),
    "max_completion_tokens": Limit(
        CHAT, "max_completion_tokens", _generated_tokens, lambda n: _chat(max_completion_tokens=n), False
    ),
    "messages": Limit(CHAT, "messages", _prompt_tokens, lambda n: {"messages": [{"role": "user"}] * n}, False),
    "a message's text": Limit(CHAT, "messages", _prompt_chars, lambda n: _message(content="a" * n), False),
    "a message's name": Limit(CHAT, "messages", _prompt_chars, lambda n: _message(name="a" * n), False),
    "a text part": Limit(
        CHAT, "messages", _prompt_chars, lambda n: _message(content=[{"type": "text", "text": "a" * n}]), False
    ),
}


@pytest.mark.parametrize("limit", LIMITS)
def test_limits_are_documented_as_enforced(app, client, limit):
    """The document declared none of the request limits (stop strings and ids, prompt and message lengths, token
    ids, max_tokens): each is now declared where it applies, at exactly the value enforced. A body one over it
    violates the document and is refused with a 400 naming the field; a body at it is valid."""
    path, param, bound, body, served_at_bound = LIMITS[limit]
    at, over = body(bound(app.state.model)), body(bound(app.state.model) + 1)
    request = _request_schema(
        _document(client), "CompletionRequest" if path == COMPLETIONS else "ChatCompletionRequest"
    )
    assert request.is_valid(at) and not request.is_valid(over)
    resp = client.post(path, json=over)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text[:300]
    if served_at_bound:
        assert client.post(path, json=at).status_code == 200


def test_the_body_limit_is_documented(client):
    """413 said "the gateway's limit" without saying it."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        described = _document(client)["paths"][path]["post"]["responses"]["413"]["description"]
        assert described.endswith(f"limit of {64 << 10} bytes")
        resp = client.post(path, content=b" " * ((64 << 10) + 1), headers={"content-type": "application/json"})
        assert resp.status_code == 413


class OverloadedBackend(WorkerLikeBackend):
    async def open(self, job):
        raise Overloaded("the queue is full", retry_after_s=7)


def _validated_call(app, path: str, body: dict):
    """One request through schemathesis, its response checked against the document (headers included)."""
    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call()
    case.validate_response(response, checks=[*CHECKS, openapi_checks.response_headers_conformance])
    return response


def test_retry_after_is_documented(checkpoint, backend):
    """429 said "retry after `Retry-After` seconds" but declared no such header."""
    app = create_app(settings_for(checkpoint), OverloadedBackend(backend.tokenizer, backend.vocab_size, 2048))
    with TestClient(app) as client:
        paths = _document(client)["paths"]
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", _chat())):
        header = paths[path]["post"]["responses"]["429"]["headers"]["Retry-After"]
        assert header["required"] and header["schema"] == {"type": "integer", "minimum": 1, "maximum": 60}
        response = _validated_call(app, path, body)
        assert response.status_code == 429 and response.headers["retry-after"] == ["7"]


def test_both_503s_are_documented(checkpoint, backend, monkeypatch):
    """The completion routes' 503 said only "no worker": a draining gateway answers it too."""
    draining = Drain(30.0)
    draining.begin(time.monotonic())
    app = create_app(settings_for(checkpoint), backend, draining)
    with TestClient(app) as client:
        described = _document(client)["paths"]["/v1/completions"]["post"]["responses"]["503"]["description"]
    assert "No worker" in described and "draining" in described
    assert "draining" in _validated_call(app, "/v1/completions", {"prompt": "hi"}).json()["error"]["message"]
    monkeypatch.setattr(backend, "unavailable", "no decode worker")
    response = _validated_call(create_app(settings_for(checkpoint), backend), "/v1/chat/completions", _chat())
    assert response.status_code == 503 and "no decode worker" in response.json()["error"]["message"]


def test_the_api_key_is_documented(checkpoint, backend):
    """The document did not say that /v1 takes `Authorization: Bearer <key>`: with keys set, every /v1 (and tokenizer)
    operation requires the bearer scheme, and nothing else does; without keys, nothing requires it."""
    with TestClient(create_app(settings_for(checkpoint, api_keys=("sk-documented",)), backend)) as client:
        keyed = _document(client)
        assert client.get("/v1/models").status_code == 401
    with TestClient(create_app(settings_for(checkpoint), backend)) as client:
        open_ = _document(client)
    for document in (keyed, open_):
        scheme = document["components"]["securitySchemes"][API_KEY_SCHEME]
        assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
        assert "security" not in document  # the probes need no key
    for path, item in keyed["paths"].items():
        for operation in item.values():
            assert operation.get("security") == ([{API_KEY_SCHEME: []}] if _keyed(path) else None), path
    assert all("security" not in op for item in open_["paths"].values() for op in item.values())
