"""OpenAI-compatible request and response bodies, as vLLM and SGLang serve them.

Requests decode strictly (a string where a number belongs is a 400, not a guess); unknown fields are
ignored because benchmark clients send extras. Fields are Optional where clients are known to send
`null`. Ranges the schema can express are declared here (and so appear in /schema); the rest is
checked in prepare.py. `responses` and `StreamingOperation` document what a route answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, Schema
from msgspec import Meta

from services.gateway.errors import error_responses


def _documented(**schema: Any) -> Meta:
    """JSON Schema for the OpenAPI document only: what prepare.py enforces (with clearer messages than a
    decoding error would give) or what litestar leaves out (a bound that is falsy: ge=0.0 would vanish from
    /schema and temperature -1 would look valid). Keys are litestar's Schema field names."""
    return Meta(extra_json_schema={"extra": schema})


def _only(*values: Any) -> Meta:
    """A parameter accepted for compatibility whose only supported values are these (prepare.py refuses others)."""
    return _documented(enum=[*values, None])


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = {"type": "string", "minLength": 1}

MaxTokens = Annotated[int, Meta(ge=1, description="tokens to generate at most")]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 = greedy"), _documented(minimum=0.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0), _documented(exclusive_minimum=0.0)]
TopK = Annotated[int, Meta(ge=-1, description="0 or -1 = off")]
TokenIds = Annotated[list[int], _documented(items={"type": "integer", "minimum": 0})]
Prompt = Annotated[
    str | list[Any],
    _documented(
        description="a string, token ids, or a one-element list of either",
        one_of=[
            _PROMPT,
            _TOKEN_IDS,
            {"type": "array", "items": {"oneOf": [_PROMPT, _TOKEN_IDS]}, "minItems": 1, "maxItems": 1},
        ],
    ),
]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct):
    type: Annotated[str, _documented(enum=["text"])]
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Annotated[str, _documented(enum=list(CHAT_ROLES))]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # None = the served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    seed: int | None = None
    n: Annotated[int | None, _only(1)] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], _documented(min_items=1)]
    max_completion_tokens: MaxTokens | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: Annotated[bool | None, _only(False)] = None
    top_logprobs: Annotated[int | None, _only(0)] = None
    response_format: Annotated[dict[str, Any] | None, _documented(properties={"type": {"enum": ["text"]}})] = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: Prompt
    logprobs: Annotated[int | None, _only()] = None
    echo: Annotated[bool | None, _only(False)] = None
    best_of: Annotated[int | None, _only(1)] = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None  # only on the first chunk
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: None = None


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
    logprobs: None = None


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


@dataclass
class StreamingOperation(Operation):
    """An operation whose 200 is JSON, or server-sent events with `stream: true` (litestar documents one media
    type per status; this adds the second)."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
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
