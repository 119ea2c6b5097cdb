"""OpenAI-compatible request and response bodies, as vLLM and SGLang serve them.

Requests decode strictly (a string where a number belongs is a 400, not a guess); unknown fields are
ignored because benchmark clients send extras. Fields are Optional where clients are known to send
`null`. Ranges and limits are declared here (and so appear in /schema/openapi.json); prepare.py enforces
them, and the rest, with 400s naming the field. Limits that depend on the served model (prompt length, the
vocabulary) differ between gateways: `declare_limits` writes them into each app's document. `responses` and
`CompletionOperation` document what a route answers; `SECURITY_SCHEMES` how /v1 takes an API key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPI,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Reference,
    Schema,
    SecurityScheme,
)
from msgspec import Meta

from services.gateway.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S
from services.gateway.errors import error_responses
from services.gateway.served_model import ServedModel
from shared import sampling_spec as spec
from shared.messages import range_meta

# Limits on what any request may ask for (prepare.py refuses more with a 400 naming the field).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: the held-back check costs its length squared per generated token
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_FIELD_CHARS = 256  # cache_salt, prompt_cache_key: names, not content


def _documented(**schema: Any) -> Meta:
    """JSON Schema for the OpenAPI document only: what prepare.py enforces (with clearer messages than a
    decoding error would give) or what litestar leaves out (a bound that is falsy: ge=0.0 would vanish from
    /schema and temperature -1 would look valid). Keys are litestar's Schema field names."""
    return Meta(extra_json_schema={"extra": schema})


def _only(*values: Any) -> Meta:
    """A parameter accepted for compatibility whose only supported values are these (prepare.py refuses others)."""
    return _documented(enum=[*values, None])


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_FORMATS = ["text", "json_object", "json_schema"]
_NULL = {"type": "null"}
_TOKEN_ID = {"type": "integer", "minimum": 0}  # and below the vocabulary size: declare_limits
_STOP_STRING = {"type": "string", "maxLength": MAX_STOP_CHARS}


def _prompt_forms(text: dict[str, Any], token_ids: dict[str, Any]) -> list[dict[str, Any]]:
    return [text, token_ids, {"type": "array", "items": {"oneOf": [text, token_ids]}, "minItems": 1, "maxItems": 1}]


def _stop_token_ids_forms(token_id: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "array", "items": token_id, "maxItems": MAX_STOP_TOKEN_IDS}, _NULL]


def _declared(field: spec.SamplingField[object], description: str | None = None, *, api: bool = True) -> Meta:
    """A sampling field's bounds and description, from its declaration (shared/sampling_spec.py): the API's own range
    where it has one (`api`), else the wire's. A bound of 0 is also written for the OpenAPI document (_documented)."""
    r = (field.api_range if api else None) or field.range or spec.Range()
    zero = {"minimum": r.ge, "exclusive_minimum": r.gt, "maximum": r.le, "exclusive_maximum": r.lt}
    extra = {"extra": {k: v for k, v in zero.items() if v == 0}} if 0 in zero.values() else None
    return range_meta(r, description or field.doc, extra_json_schema=extra)


# The API's ranges, descriptions and defaults are the declared ones; OpenAI's temperature range is narrower than the
# engine's, and its top_k has an "off" value (0 or -1) where the wire has null (sampling_spec.py says both).
MaxTokens = Annotated[int, _declared(spec.MAX_TOKENS)]
Temperature = Annotated[float, _declared(spec.TEMPERATURE)]
TopP = Annotated[float, _declared(spec.TOP_P)]
TopK = Annotated[int, _declared(spec.TOP_K)]
PresencePenalty = Annotated[float, _declared(spec.PRESENCE_PENALTY)]
FrequencyPenalty = Annotated[float, _declared(spec.FREQUENCY_PENALTY)]
RepetitionPenalty = Annotated[float, _declared(spec.REPETITION_PENALTY)]
MinP = Annotated[float, _declared(spec.MIN_P)]
_BIAS = spec.LOGIT_BIAS.item_range or spec.Range()
LogitBiasMap = Annotated[
    dict[str, float] | None, _documented(description=f"token id (as a string) → bias {_BIAS.describe()}")
]
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound on `logprobs`
TopLogprobs = Annotated[int, _declared(spec.LOGPROBS, "alternatives per token")]
CompletionLogprobsCount = Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS), _documented(minimum=0)]
ScoreOrMaxTokens = Annotated[
    int, _declared(spec.MAX_TOKENS, "tokens to generate at most; 0 with echo = score the prompt", api=False)
]
# Annotated around the whole Optional: `oneOf` replaces what litestar would write, null included.
Stop = Annotated[
    str | list[str] | None,
    _documented(one_of=[_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS}, _NULL]),
]
StopTokenIds = Annotated[list[int] | None, _documented(one_of=_stop_token_ids_forms(_TOKEN_ID))]
Prompt = Annotated[
    str | list[Any],
    _documented(
        description="a string, token ids, or a one-element list of either",
        one_of=_prompt_forms({"type": "string", "minLength": 1}, {"type": "array", "items": _TOKEN_ID, "minItems": 1}),
    ),
]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct):
    type: Annotated[str, _documented(enum=["text"])]
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None = no arguments
    strict: bool | None = None


class Tool(msgspec.Struct):
    function: FunctionDef
    type: Annotated[str, _documented(enum=["function"])] = "function"


class ChatMessage(msgspec.Struct):
    role: Annotated[str, _documented(enum=list(CHAT_ROLES))]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # None = the served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    seed: int | None = None
    n: (
        Annotated[int, Meta(ge=1, description="choices: the prompt is computed once; choice i seeded seed + i")] | None
    ) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    # the prefix cache (docs/security.md): requests with different salts never share cached blocks, and a key
    # keeps requests that share a prefix on one worker when no worker holds more of it
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_FIELD_CHARS)] | None = None
    prompt_cache_key: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_FIELD_CHARS)] | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    logit_bias: LogitBiasMap = None
    # output constraints, vLLM's spellings (services/gateway/structured.py): one of json / regex / choice / grammar
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # a JSON Schema (object or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], _documented(min_items=1)]
    max_completion_tokens: MaxTokens | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None  # with logprobs: alternatives per token
    response_format: Annotated[dict[str, Any] | None, _documented(properties={"type": {"enum": _FORMATS}})] = None
    add_generation_prompt: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}


class CompletionRequest(_Common, kw_only=True):
    prompt: Prompt
    max_tokens: ScoreOrMaxTokens | None = None  # 0 only with echo
    logprobs: CompletionLogprobsCount | None = None  # alternatives per token; 0 = the tokens' own only
    echo: bool | None = None  # the prompt before the completion (with logprobs: the prompt's too)
    best_of: (
        Annotated[int, Meta(ge=1, description="must equal n (ranking more candidates is not supported)")] | None
    ) = None
    response_format: Annotated[dict[str, Any] | None, _documented(properties={"type": {"enum": _FORMATS}})] = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # of prompt_tokens, served from the prefix cache instead of computed


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None when the message is tool calls
    refusal: None  # required by OpenAI's schema (no default, so omit_defaults keeps it): there are no refusals
    tool_calls: list[ToolCall] | None = None  # omitted when there are none


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(msgspec.Struct):
    """The legacy shape: parallel lists, one entry per token (a prompt's first token has null logprobs)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # on a call's first delta
    arguments: str | None = None  # fragments, to be concatenated


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionCallDelta
    id: str | None = None  # on a call's first delta, with type
    type: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None  # only on the first chunk
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the usage chunk (choices = [])


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    """Both the whole response (object "text_completion", with usage) and a stream chunk (same object name)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class Status(msgspec.Struct, omit_defaults=True):
    status: str
    detail: str | None = None


# ---- the OpenAPI document -------------------------------------------------------------------------------


def responses(success: Any, *errors: int) -> dict[int, ResponseSpec]:
    """A route's documented answers: 200 with `success`, and each error status in the OpenAI error shape."""
    return {200: ResponseSpec(success, description="OK", generate_examples=False), **error_responses(*errors)}


# what a completion route can answer besides 200 (401 only when the gateway has API keys)
COMPLETION_ERRORS = (400, 401, 404, 413, 415, 429, 500, 503, 504)

RETRY_AFTER = OpenAPIHeader(
    schema=Schema(type=OpenAPIType.INTEGER, minimum=RETRY_AFTER_MIN_S, maximum=RETRY_AFTER_MAX_S),
    required=True,
    description="Whole seconds to wait before sending the request again",
)


@dataclass
class CompletionOperation(Operation):
    """A completion route's operation, with what litestar's `responses=` cannot say: a 200 that is JSON, or
    server-sent events with `stream: true` (litestar documents one media type per status); the 429's
    Retry-After header; both reasons for a 503."""

    def __post_init__(self) -> None:
        # litestar writes each of these from error_responses / the route: an OpenAPIResponse, never a Reference
        answers = {status: _response(r) for status, r in (self.responses or {}).items()}
        ok = answers.get("200")
        if ok is not None and ok.content is not None:
            # an event stream's schema describes one event (how schemathesis and OpenAPI 3.2 read it)
            event = Schema(
                type=OpenAPIType.OBJECT,
                required=["data"],
                properties={
                    "data": Schema(
                        type=OpenAPIType.STRING,
                        description="a chunk as JSON (ChatCompletionChunk / Completion), then `[DONE]`",
                    )
                },
            )
            ok.content["text/event-stream"] = OpenAPIMediaType(schema=event)
        if (overloaded := answers.get("429")) is not None:
            headers: dict[str, OpenAPIHeader | Reference] = {"Retry-After": RETRY_AFTER}
            overloaded.headers = headers
        if (unavailable := answers.get("503")) is not None:
            unavailable.description = (
                "No worker can serve the request now, or the gateway is draining (shutting down): send it again "
                "later, or to another replica"
            )


# /v1 takes `Authorization: Bearer <key>` when the gateway has API keys (middleware.api_key_guard); the probes,
# /metrics and /schema never do. The scheme is always declared; operations require it only with keys set.
API_KEY_SCHEME = "api_key"
SECURITY_SCHEMES: dict[str, SecurityScheme | Reference] = {
    API_KEY_SCHEME: SecurityScheme(
        type="http",
        scheme="bearer",
        description="One of the gateway's API keys (settings api_keys), as `Authorization: Bearer <key>`",
    )
}
API_KEY_REQUIRED = [{API_KEY_SCHEME: []}]


def declare_limits(document: OpenAPI, model: ServedModel, max_body_bytes: int) -> None:
    """Write into one app's `document` the limits that depend on its model and settings, which the request
    classes cannot carry (their schemas are the same for every app): the longest prompt in tokens and in
    characters, the vocabulary, the context, the body size. prepare.py (litestar for the body) enforces each."""
    schemas = document.components.schemas
    token_id = {**_TOKEN_ID, "maximum": model.vocab_size - 1}
    text = {"type": "string", "minLength": 1, "maxLength": model.max_prompt_chars}
    token_ids = {"type": "array", "items": token_id, "minItems": 1, "maxItems": model.max_prompt_tokens}
    completion = _properties(schemas["CompletionRequest"])
    chat = _properties(schemas["ChatCompletionRequest"])
    # new lists and dicts throughout: the annotations' own are shared by every app
    _set_one_of(completion["prompt"], _prompt_forms(text, token_ids))
    for request in (completion, chat):
        _set_one_of(request["stop_token_ids"], _stop_token_ids_forms(token_id))
        _schema(request["n"]).maximum = model.max_n  # settings.max_n
        for field in ("max_tokens", "max_completion_tokens"):
            if field in request:  # a prompt has at least one token
                _schema(request[field]).maximum = model.max_model_len - 1  # beside litestar's minimum
    messages = _schema(chat["messages"])
    messages.max_items = model.max_prompt_tokens
    messages.description = (
        f"at most {model.max_prompt_tokens} messages, with at most {model.max_prompt_chars} characters of text in "
        "all (names included, and the chat template's own text once rendered)"
    )
    message, part = _properties(schemas["ChatMessage"]), _properties(schemas["ContentPart"])
    for field in (message["content"], message["name"], part["text"]):  # each is part of the text in all
        _form(field, OpenAPIType.STRING).max_length = model.max_prompt_chars
    for path in (document.paths or {}).values():
        for operation in (path.get, path.post):
            too_large = (operation.responses or {}).get("413") if operation is not None else None
            if too_large is not None:
                too_large.description = f"The request body is larger than the gateway's limit of {max_body_bytes} bytes"


def _response(response: OpenAPIResponse | Reference) -> OpenAPIResponse:
    assert isinstance(response, OpenAPIResponse), response
    return response


def _schema(schema: Schema | Reference) -> Schema:
    assert isinstance(schema, Schema), schema
    return schema


def _set_one_of(schema: Schema | Reference, forms: list[dict[str, Any]]) -> None:
    """Replace `schema`'s oneOf by raw JSON Schema `forms`, which litestar writes into the document as they are
    (as it does those of _documented); its annotation names only Schema and Reference."""
    _schema(schema).one_of = forms  # pyright: ignore[reportAttributeAccessIssue]


def _properties(schema: Schema | Reference) -> dict[str, Schema | Reference]:
    return _schema(schema).properties or {}


def _form(schema: Schema | Reference, kind: OpenAPIType) -> Schema:
    """The `kind` alternative of an Optional field's oneOf."""
    return next(f for f in _schema(schema).one_of or () if isinstance(f, Schema) and f.type == kind)
