"""Qwen / Hermes tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them,
text around them being content."""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tools.parsers import ParsedCall, StreamDelta, call_from_json, call_schema
from shared.structured.spec import StructuredSpec, lark

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_KEYS = ("arguments", "parameters")


class HermesParser:
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        content_parts: list[str] = []
        last = 0
        for m in _CALL.finditer(text):
            call = _decode(m.group(1))
            if call is None:
                continue  # not a call after all: stays content
            content_parts.append(text[last : m.start()])
            last = m.end()
            calls.append(call)
        content_parts.append(text[last:])
        content = "".join(content_parts)
        if calls and not content.strip():
            return None, calls
        return content, calls

    def stream(self) -> HermesStream:
        return HermesStream()

    def constraint(self, tools: list[dict[str, Any]]) -> StructuredSpec:
        schema = json.dumps(call_schema(tools, "arguments"))
        return lark(f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {schema}')


def _decode(body: str) -> ParsedCall | None:
    try:
        return call_from_json(json.loads(body), _KEYS)
    except json.JSONDecodeError:
        return None


class HermesStream:
    """Content passes through, except what may be the start of `<tool_call>` (held until it is not); a call is
    held until its `</tool_call>`, then emitted whole (name first, then its arguments: sse.py splits them)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._count = 0

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        content: list[str] = []
        calls: list[tuple[int, ParsedCall]] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(CLOSE)
            if j < 0:
                break
            block, self._buf = self._buf[: j + len(CLOSE)], self._buf[j + len(CLOSE) :]
            self._in_call = False
            call = _decode(block[len(OPEN) : -len(CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append((self._count, call))
                self._count += 1
        return StreamDelta("".join(content), calls)

    def finish(self) -> StreamDelta:
        rest, self._buf = self._buf, ""
        return StreamDelta(rest)

    @property
    def found_calls(self) -> bool:
        return self._count > 0


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
