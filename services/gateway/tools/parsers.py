"""What a tool-call parser does, the calls it finds, and the helpers the parsers share (the parsers import this
module; choosing one for a model is registry.py's, which imports them).

A parser reads the model's whole text (`parse`) or follows it as it streams (`stream()` → a StreamParser fed
each text delta); both give the text outside the calls as content and each call as a name plus its arguments as
JSON text. `constraint` is the grammar that makes the output one or more calls of the given tools (tool_choice
required or a named function), in the family's own syntax, so that even a random model writes a valid call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.structured.spec import StructuredSpec

# JSON inside a call written compactly, as the JSON response formats are (shared/structured/grammar.py)
JSON_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class CallFragment:
    """Part of a streamed call: its first fragment has `id` and `name` (arguments usually ""), the next ones
    pieces of the arguments' JSON text, to be concatenated."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


def whole_call(index: int, call: ParsedCall) -> list[CallFragment]:
    """A call known at once: its head, then all its arguments."""
    return [CallFragment(index, "", call.name, call.id), CallFragment(index, call.arguments)]


@dataclass(frozen=True)
class StreamDelta:
    """What one text delta adds: content, and fragments of calls."""

    content: str = ""
    calls: list[CallFragment] = field(default_factory=list)


class StreamParser(Protocol):
    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta:
        """The end of the output: whatever was held back (an unfinished call is content)."""
        ...


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): content None when the text is only calls."""
        ...

    def stream(self) -> StreamParser: ...

    def constraint(self, tools: list[dict[str, Any]]) -> StructuredSpec:
        """Output that is one call of one of `tools` (each {"name", "parameters"}), in this family's syntax."""
        ...


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """JSON Schema of one call object {"name": ..., arguments_key: {...}} of any of `tools`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                arguments_key: t.get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {**(options[0] if len(options) == 1 else {"anyOf": options}), **JSON_LAYOUT}


def call_from_json(obj: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded {"name": ..., "arguments" | "parameters": {...}}; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
