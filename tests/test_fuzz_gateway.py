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

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from litestar.testing import TestClient
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

from services.gateway import create_app
from services.gateway.backend import GenerationJob, Update
from services.gateway.prepare import CHAT_ROLES
from services.gateway.schemas import CHAT_ROLES as DOCUMENTED_ROLES
from shared.job_checks import job_refusal
from shared.messages import PrefillJob, decode, encode, token_subject
from shared.model.demo import write_demo_checkpoint
from shared.model.tokenizer import Tokenizer
from shared.worker import sampling_params
from tests.test_gateway import MODEL, FakeBackend, FakeStream, settings_for

EXAMPLES = 100  # per operation and generation mode: the whole file runs in well under a minute
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
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def backend(checkpoint):
    tokenizer = Tokenizer(checkpoint)
    return WorkerLikeBackend(tokenizer, vocab_size=259, max_model_len=2048)


@pytest.fixture(scope="module")
def app(checkpoint, backend):
    return create_app(settings_for(checkpoint), backend)


@pytest.fixture(scope="module")
def gateway_schema(app):
    # whole event streams (schemathesis cuts them at 20 events by default), to check how they end
    config = schemathesis.Config.from_dict(
        {"seed": SEED, "generation": {"deterministic": True}, "max-stream-events": 10_000}
    )
    return schemathesis.openapi.from_asgi("/schema/openapi.json", app, config=config)


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


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
}
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
        assert set(statuses) <= {400, 404, 413, 415}


def test_fuzz_without_the_api_key(checkpoint, backend):
    """With API keys set, every /v1 operation answers anything without a key with a documented 401."""
    app = create_app(settings_for(checkpoint, api_keys=("sk-fuzz",)), backend)
    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    for method, path in [op for op in OPERATIONS if op[1].startswith("/v1/")]:

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
    assert len({path for path, _ in statuses}) == 4


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
    assert completion["n"]["enum"] == [1, None] and completion["best_of"]["enum"] == [1, None]
    assert completion["echo"]["enum"] == [False, None] and completion["logprobs"]["enum"] == [None]
    assert {"type": "string", "minLength": 1} in completion["prompt"]["oneOf"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    for body in ({"prompt": "hi", "n": 2}, {"prompt": "hi", "echo": True}, {"prompt": ""}):
        assert client.post("/v1/completions", json=body).status_code == 400


def test_a_job_a_worker_would_refuse_is_a_400(client, backend):
    """A temperature of 1e-300 passes the gateway's range [0, 2] but fails inside the engine's sampler (NaN
    probabilities, on the engine thread): workers refuse it (shared/job_checks.py) and the client gets a 400
    with the reason."""
    resp = client.post("/v1/completions", json={"prompt": "hi", "temperature": 1e-300})
    assert resp.status_code == 400, resp.text
    assert "too small to sample with" in resp.json()["error"]["message"]
    assert backend.refused[-1] == resp.json()["error"]["message"]


def test_a_text_part_without_text_is_named_so(client):
    """A `{"type": "text"}` part with no text was refused as "got a 'text' part"."""
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "only text content is supported, got a text part without `text`"
