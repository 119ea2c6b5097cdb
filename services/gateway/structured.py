"""A request's output constraint, from whichever field spells it, compiled here so that a bad schema, regex or
grammar is a 400 naming the field before anything is dispatched (the compiled grammar is cached: workers
compile the same spec again, cheaply, against the same tokenizer).

Spellings, at most one per request (two are a 400): OpenAI's `response_format` (`text`, `json_object`,
`json_schema` with `json_schema: {name, schema, strict}`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`: one key) and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
Tool calls (`tool_choice` required or a named function) constrain the output the same way (tools.py).
"""

from __future__ import annotations

from typing import Any

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared.structured import spec as specs
from shared.structured.grammar import GrammarError, Grammars
from shared.structured.spec import StructuredSpec

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


def requested_spec(req: ChatCompletionRequest | CompletionRequest) -> tuple[StructuredSpec, str] | None:
    """The request's constraint and the field that asked for it (for the 400s), or None."""
    found: list[tuple[StructuredSpec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        found.append(_structured_outputs(req.structured_outputs))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice}
    guided["grammar"] = req.guided_grammar
    for key, value in guided.items():
        if value is not None:
            found.append((_one(key, value, f"guided_{key}"), f"guided_{key}"))
    if len(found) > 1:
        raise APIError(400, f"set one output constraint, got {', '.join(f for _, f in found)}", found[1][1])
    return found[0] if found else None


def checked(spec: StructuredSpec, param: str, grammars: Grammars) -> StructuredSpec:
    """`spec`, once it compiles; else a 400 naming `param` and what is wrong."""
    try:
        grammars.check(spec)
    except GrammarError as exc:
        raise APIError(400, f"invalid {param}: {exc}", param) from exc
    return spec


def _response_format(rf: dict[str, Any]) -> StructuredSpec | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return specs.JSON_OBJECT
    if kind != "json_schema":
        raise APIError(
            400, f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
        )
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise APIError(400, "response_format.json_schema needs a `name` (and a `schema`)", "response_format")
    schema = js.get("schema", {})  # OpenAI: no schema = any JSON
    if not isinstance(schema, dict | bool):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return specs.json_schema(schema)


def _structured_outputs(so: dict[str, Any]) -> tuple[StructuredSpec, str]:
    keys = [k for k in _STRUCTURED_KEYS if so.get(k) is not None]
    if len(keys) != 1:
        raise APIError(
            400, f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KEYS)}", "structured_outputs"
        )
    return _one(keys[0], so[keys[0]], "structured_outputs"), "structured_outputs"


def _one(key: str, value: Any, param: str) -> StructuredSpec:
    if key == "json":
        if isinstance(value, str):  # vLLM accepts the schema as JSON text too
            return StructuredSpec(specs.StructuredKind.JSON_SCHEMA, value)
        if not isinstance(value, dict | bool):
            raise APIError(400, f"{param}: json must be a JSON Schema", param)
        return specs.json_schema(value)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param}: choice must be a non-empty list of non-empty strings", param)
        return specs.choice(value)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: {key} must be a non-empty string", param)
    return specs.regex(value) if key == "regex" else specs.lark(value)
