"""OpenAI-compatible request and response bodies, as vLLM and SGLang serve them.

Requests decode strictly (a string where a number belongs is a 400, not a guess); unknown fields are
ignored because benchmark clients send extras. Fields are Optional where clients are known to send
`null`. Ranges the schema can express are declared here (and so appear in /schema); the rest is
checked in prepare.py.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

MaxTokens = Annotated[int, Meta(ge=1, description="tokens to generate at most")]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 = greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, description="0 or -1 = off")]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # None = the served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


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
