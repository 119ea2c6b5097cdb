"""Llama 3.1 / 3.2 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several joined by `; `), as the Llama 3.1 chat template asks for with custom tools."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tools.parsers import ParsedCall, StreamDelta, call_from_json, call_schema, whole_call
from shared.structured.spec import StructuredSpec, json_schema

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = call_from_json(obj, _KEYS)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " ;\n\t":
                pos += 1
        return None, calls

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)

    def constraint(self, tools: list[dict[str, Any]]) -> StructuredSpec:
        return json_schema(call_schema(tools, "parameters"))


class Llama3JsonStream:
    """A reply that starts with `{` (or the python tag) is held to its end and parsed whole; any other streams
    as content."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        self._parser = parser
        self._buf = ""
        self._holding: bool | None = None  # None: not decided yet (only whitespace so far)
        self._count = 0

    def feed(self, text: str) -> StreamDelta:
        if self._holding is False:
            return StreamDelta(text)
        self._buf += text
        head = self._buf.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return StreamDelta()
        self._holding = head.startswith(("{", PYTHON_TAG))
        if not self._holding:
            out, self._buf = self._buf, ""
            return StreamDelta(out)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        text, self._buf = self._buf, ""
        if not self._holding:
            return StreamDelta(text)
        content, calls = self._parser.parse(text)
        self._count = len(calls)
        return StreamDelta(content or "", [f for i, c in enumerate(calls) for f in whole_call(i, c)])

    @property
    def found_calls(self) -> bool:
        return self._count > 0
