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


def new_request_id(chat: bool) -> str:
    """Unique, and safe as a NATS subject token (letters, digits, '-')."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage_of(gen: Generation | ChoiceSet) -> Usage:
    """As OpenAI counts: the prompt once, the completion tokens of every choice."""
    return Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)


class ResponseWriter:
    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._role_sent: set[int] = set()  # choices whose first chat chunk (with the role) went out

    def whole(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The non-streaming response, after gen (one choice, or n) ran to its end."""
        gens = gen.gens if isinstance(gen, ChoiceSet) else [gen]
        if self.chat:
            choices = [
                ChatChoice(
                    index=i,
                    message=AssistantMessage(role="assistant", content=g.text.text),
                    finish_reason=g.finish_reason,
                )
                for i, g in enumerate(gens)
            ]
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

    def usage_chunk(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        if self.chat:
            return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage_of(gen))
        return Completion(self.id, "text_completion", self.created, self.model, [], usage_of(gen))
