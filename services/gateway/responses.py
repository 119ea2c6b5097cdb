"""The response bodies of one request: whole (non-streaming) and per chunk (streaming), chat and text.

`ResponseWriter` fixes what every chunk of a response shares (id, created, model) and knows which
API's shape to produce; sse.py frames what it builds.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from services.gateway.generation import Generation, Piece
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
)
from services.gateway.tools.output import ToolDeltas, tool_message
from services.gateway.tools.parsers import ToolParser


def new_request_id(chat: bool) -> str:
    """Unique, and safe as a NATS subject token (letters, digits, '-')."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage_of(gen: Generation) -> Usage:
    return Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)


class ResponseWriter:
    def __init__(self, request_id: str, model: str, chat: bool, tool_parser: ToolParser | None = None) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._role_sent = False
        self.tool_parser = tool_parser  # chat with tools: text is read back into tool_calls (tools/output.py)
        self._tool_deltas = ToolDeltas(tool_parser) if tool_parser is not None else None

    def whole(self, gen: Generation) -> msgspec.Struct:
        """The non-streaming response, after gen ran to its end."""
        if self.chat:
            message = AssistantMessage(role="assistant", refusal=None, content=gen.text.text)
            finish_reason = gen.finish_reason
            if self.tool_parser is not None:
                message, finish_reason = tool_message(gen.text.text, self.tool_parser, finish_reason)
            choice = ChatChoice(index=0, message=message, finish_reason=finish_reason)
            return ChatCompletion(self.id, "chat.completion", self.created, self.model, [choice], usage_of(gen))
        choice = CompletionChoice(index=0, text=gen.text.text, finish_reason=gen.finish_reason)
        return Completion(self.id, "text_completion", self.created, self.model, [choice], usage_of(gen))

    def chunk(self, piece: Piece) -> msgspec.Struct:
        """One token's chunk; the first chat chunk carries the assistant role."""
        if not self.chat:
            choice = CompletionChoice(index=0, text=piece.text, finish_reason=piece.finish_reason)
            return Completion(self.id, "text_completion", self.created, self.model, [choice])
        delta = ChatDelta(role=None if self._role_sent else "assistant", content=piece.text)
        self._role_sent = True
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=piece.finish_reason)
        return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def chunks(self, piece: Piece) -> list[msgspec.Struct]:
        """A token's chunks: one, or with tools what the parser lets out (none while it holds a possible call,
        several when a call completes)."""
        if self._tool_deltas is None:
            return [self.chunk(piece)]
        chunks: list[msgspec.Struct] = []
        for out in self._tool_deltas.feed(piece.text, piece.finish_reason):
            delta = out.delta
            if not self._role_sent:
                delta.role = "assistant"
                self._role_sent = True
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=out.finish_reason)
            chunks.append(ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice]))
        return chunks

    def usage_chunk(self, gen: Generation) -> msgspec.Struct:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        if self.chat:
            return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage_of(gen))
        return Completion(self.id, "text_completion", self.created, self.model, [], usage_of(gen))
