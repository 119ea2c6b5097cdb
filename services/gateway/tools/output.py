"""Tool calls into the response: the whole message (`tool_message`) and, streaming, the deltas OpenAI sends
(`ToolDeltas`): a call's first delta has its index, id, type and function name (arguments ""), the next ones
its argument fragments; the last chunk's finish_reason is "tool_calls" when the reply made calls."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.schemas import (
    AssistantMessage,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from services.gateway.tools.parsers import ParsedCall, StreamDelta, ToolParser

TOOL_CALLS = "tool_calls"


def tool_message(text: str, parser: ToolParser, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished reply, and its finish_reason ("tool_calls" when it made calls)."""
    content, calls = parser.parse(text)
    if not calls:
        return AssistantMessage(role="assistant", content=text), finish_reason
    tool_calls = [ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls]
    return AssistantMessage(role="assistant", content=content, tool_calls=tool_calls), TOOL_CALLS


@dataclass
class DeltaOut:
    delta: ChatDelta
    finish_reason: str | None = None


class ToolDeltas:
    """One streamed reply through a parser: each token's text in, the chunk deltas to send out."""

    def __init__(self, parser: ToolParser) -> None:
        self._stream = parser.stream()
        self._calls = 0

    def feed(self, text: str, finish_reason: str | None) -> list[DeltaOut]:
        parsed = self._stream.feed(text)
        out = self._deltas(parsed)
        if finish_reason is None:
            return out
        out += self._deltas(self._stream.finish())
        reason = TOOL_CALLS if self._calls else finish_reason
        if out and out[-1].finish_reason is None and out[-1].delta.tool_calls is None:
            out[-1].finish_reason = reason
        else:
            out.append(DeltaOut(ChatDelta(), reason))
        return out

    def _deltas(self, parsed: StreamDelta) -> list[DeltaOut]:
        out = [DeltaOut(ChatDelta(content=parsed.content))] if parsed.content else []
        for index, call in parsed.calls:
            out += _call_deltas(index, call)
            self._calls += 1
        return out


def _call_deltas(index: int, call: ParsedCall) -> list[DeltaOut]:
    head = ToolCallDelta(index, FunctionCallDelta(name=call.name, arguments=""), id=call.id, type="function")
    body = ToolCallDelta(index, FunctionCallDelta(arguments=call.arguments))
    return [DeltaOut(ChatDelta(tool_calls=[head])), DeltaOut(ChatDelta(tool_calls=[body]))]
