"""Fields of OpenAI's request schemas that pdserve does not serve: a 400 naming the field, never a silent drop.

The rule: a field of OpenAI's CreateChatCompletionRequest / CreateCompletionRequest that would change the output
and that pdserve would ignore is refused (`REFUSED`), unless its value asks for nothing pdserve lacks (null, and
each entry's `off` values: `store: false`, `modalities: ["text"]`). Bookkeeping that changes no output is accepted
and ignored (`BOOKKEEPING`). Fields not in OpenAI's schema stay ignored (benchmark clients send extras); every
other field is supported (decoded by schemas.py). tests/unit/test_api_fields.py holds these tables to the published
document, field by field, and docs/api.md lists the same status for each.

The body is decoded a second time into a struct of just these fields (msgspec skips the rest without building
it), after the strict decode has accepted it. `document_fields` writes both tables into the served OpenAPI
document: a refused field's schema is the values accepted (null and `off`), so a fuzzer's schema-violating data is
exactly what is refused; a bookkeeping field's is any value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPI, Schema

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Refused:
    why: str
    off: tuple[Any, ...] = ()  # values besides null that ask for nothing pdserve lacks: accepted


_CHAT_REFUSED = {
    "audio": Refused("audio output is not served"),
    "modalities": Refused("only text output is served", off=(["text"],)),
    "prediction": Refused("predicted outputs are not served"),
    "web_search_options": Refused("web search is not served"),
    "reasoning_effort": Refused("the served model does not reason", off=("none",)),
    "verbosity": Refused("verbosity control is not served"),
    "moderation": Refused("moderation is not served"),
    "service_tier": Refused("one service tier is served", off=("auto", "default")),
    "store": Refused("completions are not stored", off=(False,)),
    "functions": Refused("functions (deprecated: tools) are not served", off=([],)),
    "function_call": Refused("function_call (deprecated: tool_choice) is not served", off=("none",)),
    "stream_options.include_obfuscation": Refused("stream obfuscation is not served", off=(False,)),
    # the tool-call parsers return every call the model writes; limiting a reply to one is not served
    "parallel_tool_calls": Refused("a reply may hold several tool calls; false is not served", off=(True,)),
}
_COMPLETION_REFUSED = {
    "suffix": Refused("insertion (suffix) is not served", off=("",)),
    "stream_options.include_obfuscation": _CHAT_REFUSED["stream_options.include_obfuscation"],
}
REFUSED: dict[type[msgspec.Struct], dict[str, Refused]] = {
    ChatCompletionRequest: _CHAT_REFUSED,
    CompletionRequest: _COMPLETION_REFUSED,
}

# Accepted and ignored: each changes nothing in the output (why, for docs/api.md).
_CHAT_BOOKKEEPING = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "metadata": "tags for stored completions (none are stored)",
    "prompt_cache_retention": "how long OpenAI keeps a cached prompt",
    "prompt_cache_options": "breakpoints and lifetime of OpenAI's prompt cache",
}
BOOKKEEPING: dict[type[msgspec.Struct], dict[str, str]] = {
    ChatCompletionRequest: _CHAT_BOOKKEEPING,
    CompletionRequest: {"user": _CHAT_BOOKKEEPING["user"]},
}


def _holder(refused: dict[str, Refused]) -> type[msgspec.Struct]:
    """A struct of the refused fields' top-level names, any value."""
    names = sorted({field.split(".", 1)[0] for field in refused})
    return msgspec.defstruct("Refusable", [(name, Any, None) for name in names])


_HOLDERS = {kind: _holder(refused) for kind, refused in REFUSED.items()}


def refuse_unsupported(body: bytes, kind: type[Any]) -> None:
    """Raise APIError(400) naming the first refused field `body` (already a valid `kind`) sets to a value asking
    for what pdserve does not serve."""
    refused, holder = REFUSED.get(kind), _HOLDERS.get(kind)
    if refused is None or holder is None:
        return
    values = msgspec.json.decode(body, type=holder)
    for field, rule in refused.items():
        value = _value_at(values, field)
        if value is not None and not any(_same(value, off) for off in rule.off):
            raise APIError(400, f"`{field}` is not supported by this server: {rule.why}{_accepted(rule)}", field)


def _value_at(values: msgspec.Struct, field: str) -> Any:
    top, _, nested = field.partition(".")
    value = getattr(values, top)
    if nested:
        return value.get(nested) if isinstance(value, dict) else None
    return value


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off  # False is not 0, "" is not []


# the request components of the document, and the component a nested refused field lives in
_COMPONENTS = {ChatCompletionRequest: "ChatCompletionRequest", CompletionRequest: "CompletionRequest"}
_NESTED = {"stream_options": "StreamOptions"}


def document_fields(document: OpenAPI) -> None:
    """Add REFUSED and BOOKKEEPING fields to the request schemas of `document`, each with its status."""
    schemas = document.components.schemas
    for kind, name in _COMPONENTS.items():
        for field, rule in REFUSED[kind].items():
            top, _, nested = field.partition(".")
            component, key = (_NESTED[top], nested) if nested else (name, top)
            description = f"Not supported: {rule.why}; a value other than null{_accepted(rule, ', ')} is a 400."
            _add(schemas[component], key, Schema(enum=[None, *rule.off], description=description))
        for field, why in BOOKKEEPING[kind].items():
            properties = _schema(schemas[name]).properties or {}
            if field not in properties:  # `user` is in the request struct already
                _add(schemas[name], field, Schema(description=f"Accepted and ignored: {why}."))


def _accepted(rule: Refused, lead: str = " (accepted: null, ") -> str:
    """The off values in JSON, after `lead`; nothing when null is the only one."""
    if not rule.off:
        return ""
    values = ", ".join(msgspec.json.encode(v).decode() for v in rule.off)
    return f"{lead}{values}" + (")" if lead.startswith(" (") else "")


def _add(component: Any, key: str, schema: Schema) -> None:
    target = _schema(component)
    target.properties = {**(target.properties or {}), key: schema}


def _schema(component: Any) -> Schema:
    assert isinstance(component, Schema), component
    return component
