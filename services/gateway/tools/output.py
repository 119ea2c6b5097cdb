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
from services.gateway.tools.parsers import CallFragment, StreamDelta, ToolParser

TOOL_CALLS = "tool_calls"


def tool_message(text: str, parser: ToolParser, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished reply, and its finish_reason ("tool_calls" when it made calls)."""
    content, calls = parser.parse(text)
    if not calls:
        return AssistantMessage(role="assistant", refusal=None, content=text), finish_reason
    tool_calls = [ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls]
    reason = TOOL_CALLS if finish_reason == "stop" else finish_reason  # cut short by max_tokens: length
    return AssistantMessage(role="assistant", refusal=None, content=content, tool_calls=tool_calls), reason


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
        reason = TOOL_CALLS if self._calls and finish_reason == "stop" else finish_reason  # cut short: length
        if out and out[-1].finish_reason is None and out[-1].delta.tool_calls is None:
            out[-1].finish_reason = reason
        else:
            out.append(DeltaOut(ChatDelta(), reason))
        return out

    def _deltas(self, parsed: StreamDelta) -> list[DeltaOut]:
        out = [DeltaOut(ChatDelta(content=parsed.content))] if parsed.content else []
        for fragment in parsed.calls:
            if fragment.id is not None:
                self._calls += 1
            out.append(DeltaOut(ChatDelta(tool_calls=[_call_delta(fragment)])))
        return out


def _call_delta(f: CallFragment) -> ToolCallDelta:
    if f.id is None:
        return ToolCallDelta(f.index, FunctionCallDelta(arguments=f.arguments))
    return ToolCallDelta(f.index, FunctionCallDelta(name=f.name, arguments=f.arguments), id=f.id, type="function")
