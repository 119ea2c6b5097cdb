"""Validate a response body or stream chunk against OpenAI's published component schemas.

    from tests.openai_schema import validate
    validate(body, "CreateChatCompletionResponse")   # raises jsonschema.ValidationError, with every error

The schemas are extracted from github.com/openai/openai-openapi (tests/data/openai_openapi: the script, the
commit, the license); they are JSON Schema 2020-12. Names: CreateChatCompletionResponse,
CreateChatCompletionStreamResponse, CreateCompletionResponse, ListModelsResponse, Model, ErrorResponse (and
everything they reference). `validate_stream_chunk(chunk, chat=...)` picks the chunk's schema and
`validate_error(body)` checks an error body, each allowing only the deviation pdserve keeps on the wire
(docs/api.md, "Deviations").
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.validators import Draft202012Validator

SCHEMAS = Path(__file__).parent / "data" / "openai_openapi" / "schemas.json"
RESPONSES = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
)


@functools.cache
def _document() -> dict[str, Any]:
    return json.loads(SCHEMAS.read_text())


@functools.cache
def _validator(name: str) -> Draft202012Validator:
    document = _document()
    if name not in document["$defs"]:
        raise KeyError(f"{name} is not among the extracted schemas (tests/data/openai_openapi/extract.py ROOTS)")
    return Draft202012Validator({**document, "$ref": f"#/$defs/{name}"})


def errors(obj: Any, name: str) -> list[str]:
    """Every way `obj` fails schema `name`, as readable lines (empty when it validates)."""
    found = sorted(_validator(name).iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in found]


def validate(obj: Any, name: str) -> None:
    """Raise jsonschema.ValidationError listing every error of `obj` against OpenAI's schema `name`."""
    found = errors(obj, name)
    if found:
        raise jsonschema.ValidationError(f"not a valid {name}:\n" + "\n".join(found))


def validate_error(body: dict[str, Any]) -> None:
    """An error body: OpenAI's ErrorResponse, except that pdserve's `code` is the HTTP status as an integer (as
    vLLM's and SGLang's), where OpenAI's is a string or null."""
    copied = copy.deepcopy(body)
    error = copied.get("error")
    if isinstance(error, dict) and type(error.get("code")) is int:
        error["code"] = str(error["code"])  # only the integer is the deviation
    validate(copied, "ErrorResponse")


def validate_stream_chunk(chunk: dict[str, Any], chat: bool) -> None:
    """A streamed chunk: chat chunks are CreateChatCompletionStreamResponse. Text-completion chunks are
    CreateCompletionResponse (what OpenAI documents for the stream too) except that `finish_reason` is null
    until the last content chunk, as OpenAI itself streams it while the schema's enum has no null."""
    if chat:
        validate(chunk, "CreateChatCompletionStreamResponse")
        return
    copied = copy.deepcopy(chunk)
    for choice in copied.get("choices") or ():
        if isinstance(choice, dict) and choice.get("finish_reason", "") is None:
            choice["finish_reason"] = "length"  # any value of the enum: only null is the deviation
    validate(copied, "CreateCompletionResponse")
