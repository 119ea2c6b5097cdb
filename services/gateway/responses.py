"""The response bodies of one request: whole (non-streaming) and per chunk (streaming), chat and text.

`ResponseWriter` fixes what every chunk of a response shares (id, created, model) and knows which
API's shape to produce; sse.py frames what it builds.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from services.gateway.choices import ChoiceSet
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


def usage_of(gen: Generation | ChoiceSet) -> Usage:
    """As OpenAI counts: the prompt once, the completion tokens of every choice."""
    return Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)


class ResponseWriter:
    def __init__(self, request_id: str, model: str, chat: bool, tool_parser: ToolParser | None = None) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._role_sent: set[int] = set()  # choices whose first chat chunk (with the role) went out
        self.tool_parser = tool_parser  # chat with tools: text is read back into tool_calls (tools/output.py)
        self._tool_deltas: dict[int, ToolDeltas] = {}  # choice index → its streaming parser, made on first use

    def whole(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The non-streaming response, after gen (one choice, or n) ran to its end."""
        gens = gen.gens if isinstance(gen, ChoiceSet) else [gen]
        if self.chat:
            choices = []
            for i, g in enumerate(gens):
                message = AssistantMessage(role="assistant", refusal=None, content=g.text.text)
                finish_reason = g.finish_reason
                if self.tool_parser is not None:
                    message, finish_reason = tool_message(g.text.text, self.tool_parser, finish_reason)
                choices.append(ChatChoice(index=i, message=message, finish_reason=finish_reason))
            return ChatCompletion(self.id, "chat.completion", self.created, self.model, choices, usage_of(gen))
        texts = [CompletionChoice(index=i, text=g.text.text, finish_reason=g.finish_reason) for i, g in enumerate(gens)]
        return Completion(self.id, "text_completion", self.created, self.model, texts, usage_of(gen))

    def chunk(self, piece: Piece, index: int = 0) -> msgspec.Struct:
        """One token's chunk of choice `index`; each choice's first chat chunk carries the assistant role."""
        if not self.chat:
            choice = CompletionChoice(index=index, text=piece.text, finish_reason=piece.finish_reason)
            return Completion(self.id, "text_completion", self.created, self.model, [choice])
        delta = ChatDelta(role=None if index in self._role_sent else "assistant", content=piece.text)
        self._role_sent.add(index)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=piece.finish_reason)
        return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def chunks(self, piece: Piece, index: int = 0) -> list[msgspec.Struct]:
        """A token's chunks of choice `index`: one, or with tools what that choice's parser lets out (none while
        it holds a possible call, several when a call completes)."""
        if self.tool_parser is None:
            return [self.chunk(piece, index)]
        deltas = self._tool_deltas.get(index)
        if deltas is None:
            deltas = self._tool_deltas[index] = ToolDeltas(self.tool_parser)
        chunks: list[msgspec.Struct] = []
        for out in deltas.feed(piece.text, piece.finish_reason):
            delta = out.delta
            if index not in self._role_sent:
                delta.role = "assistant"
                self._role_sent.add(index)
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=out.finish_reason)
            chunks.append(ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice]))
        return chunks

    def usage_chunk(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        if self.chat:
            return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage_of(gen))
        return Completion(self.id, "text_completion", self.created, self.model, [], usage_of(gen))
