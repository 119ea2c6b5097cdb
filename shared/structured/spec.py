"""What a request's output must match, in one form every OpenAI / vLLM spelling reduces to.

`response_format` json_object / json_schema, vLLM's `structured_outputs` (json, regex, choice, grammar) and the
older `guided_*` fields all become one StructuredSpec: a kind and its text. It travels in the job (wire) and is
what the engine compiles, so a request constrained at the gateway is constrained identically on every worker.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import msgspec


class StructuredKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema, as JSON text
    REGEX = "regex"  # spec: a regular expression the whole output matches
    LARK = "lark"  # spec: a Lark grammar, llguidance's dialect (may embed %json{...} schemas)


class StructuredSpec(msgspec.Struct, frozen=True):
    kind: StructuredKind
    spec: str


# OpenAI's json_object: any JSON object.
JSON_OBJECT = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps({"type": "object"}))


def json_schema(schema: dict[str, Any] | bool) -> StructuredSpec:
    return StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))  # property order is output order: kept


def choice(options: list[str]) -> StructuredSpec:
    """Exactly one of `options` (vLLM's `choice`): a Lark alternation of string literals (JSON-quoted, which Lark
    reads as they are: no regex escaping to get wrong)."""
    return StructuredSpec(StructuredKind.LARK, "start: " + " | ".join(json.dumps(o) for o in options))


def regex(pattern: str) -> StructuredSpec:
    return StructuredSpec(StructuredKind.REGEX, pattern)


def lark(grammar: str) -> StructuredSpec:
    return StructuredSpec(StructuredKind.LARK, grammar)
