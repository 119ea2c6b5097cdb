"""Qwen / Hermes tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them,
text around them being content."""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tools.parsers import (
    CallFragment,
    ParsedCall,
    StreamDelta,
    call_from_json,
    call_schema,
    whole_call,
)
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
    """Content passes through, except what may be the start of `<tool_call>` (held until it is not). Inside a call,
    once `{"name": "...", "arguments": ` has been read, the call's head (index, id, name) goes out and then its
    arguments as they arrive, holding back only what may be the call's end (`}`, whitespace, part of
    `</tool_call>`). A call written another way (other key order) goes out whole when it closes; one that is
    not JSON after all is content."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet given out; inside a call, from its <tool_call> on
        self._in_call = False
        self._count = 0  # calls begun
        self._head: ParsedCall | None = None  # the current call's head, once sent
        self._args_at = 0  # where its arguments start in _buf
        self._sent = 0  # characters of its arguments sent

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        content: list[str] = []
        calls: list[CallFragment] = []
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
                calls += self._partial()
                break
            block, self._buf = self._buf[: j + len(CLOSE)], self._buf[j + len(CLOSE) :]
            self._in_call = False
            done = self._close(block)
            if done is None:
                content.append(block)
            calls += done or []
        return StreamDelta("".join(content), calls)

    def _partial(self) -> list[CallFragment]:
        """Fragments of the open call so far: its head once readable, then arguments not possibly its end."""
        out = []
        if self._head is None:
            m = _HEAD.match(self._buf, len(OPEN))
            if m is None:
                return []
            self._head = ParsedCall(json.loads(f'"{m.group(1)}"'), "")
            self._args_at, self._sent = m.end(), 0
            out.append(CallFragment(self._count, "", self._head.name, self._head.id))
        args = self._buf[self._args_at :]
        args = args[: len(args) - _partial_suffix(args, CLOSE)].rstrip()
        args = args.removesuffix("}").rstrip()  # the last } may close the call object
        if len(args) > self._sent:
            out.append(CallFragment(self._count, args[self._sent :]))
            self._sent = len(args)
        return out

    def _close(self, block: str) -> list[CallFragment] | None:
        """The rest of a call that just closed (None: it was not a call, and is content)."""
        head, self._head = self._head, None
        if head is None:
            call = _decode(block[len(OPEN) : -len(CLOSE)].strip())
            if call is None:
                return None
            self._count += 1
            return whole_call(self._count - 1, call)
        self._count += 1
        args = block[self._args_at : -len(CLOSE)].rstrip().removesuffix("}").rstrip()
        return [CallFragment(self._count - 1, args[self._sent :])] if len(args) > self._sent else []

    def finish(self) -> StreamDelta:
        rest, self._buf = self._buf, ""
        if self._head is not None:  # an unfinished call, already begun: the rest is its arguments
            return StreamDelta("", [CallFragment(self._count, rest[self._args_at + self._sent :])])
        return StreamDelta(rest)


# a call's start as Hermes templates write it: {"name": "<name>", "arguments": <the arguments follow>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
