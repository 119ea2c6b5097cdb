"""The response bodies of one request: whole (non-streaming) and per chunk (streaming), chat and text.

`ResponseWriter` fixes what every chunk of a response shares (id, created, model) and knows which
API's shape to produce; sse.py frames what it builds.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from services.gateway.generation import Generation, Piece
from services.gateway.logprobs_render import TokenTexts, chat_logprobs, completion_logprobs
from services.gateway.sampling_fields import Scoring
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
)
from services.gateway.tools.output import ToolDeltas, tool_message
from services.gateway.tools.parsers import ToolParser
from shared.messages import Logprob
from shared.model.tokenizer import Tokenizer


def new_request_id(chat: bool) -> str:
    """Unique, and safe as a NATS subject token (letters, digits, '-')."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage_of(gen: Generation) -> Usage:
    return Usage(gen.prompt_tokens, gen.completion_tokens, gen.prompt_tokens + gen.completion_tokens)


class ResponseWriter:
    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        tool_parser: ToolParser | None = None,
        tokenizer: Tokenizer | None = None,  # needed with logprobs or echo
        scoring: Scoring | None = None,  # None = no logprobs, no echo
        prompt_token_ids: list[int] | None = None,  # echo
    ) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._role_sent = False
        self.tool_parser = tool_parser  # chat with tools: text is read back into tool_calls (tools/output.py)
        self._tool_deltas = ToolDeltas(tool_parser) if tool_parser is not None else None
        self.scoring = scoring = scoring or Scoring()
        self._texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._prompt = list(prompt_token_ids or [])
        self._echo_pending = scoring.echo  # streaming: the first chunk carries the prompt
        self._offset = 0  # completions with logprobs: characters of the choice's text streamed so far

    def whole(self, gen: Generation) -> msgspec.Struct:
        """The non-streaming response, after gen ran to its end."""
        if self.chat:
            message = AssistantMessage(role="assistant", refusal=None, content=gen.text.text)
            finish_reason = gen.finish_reason
            if self.tool_parser is not None:
                message, finish_reason = tool_message(gen.text.text, self.tool_parser, finish_reason)
            logprobs = self._chat_logprobs(gen.token_ids, gen.logprobs)
            choice = ChatChoice(index=0, message=message, finish_reason=finish_reason, logprobs=logprobs)
            return ChatCompletion(self.id, "chat.completion", self.created, self.model, [choice], usage_of(gen))
        text, ids, lps = self._completion_parts(gen, gen.text.text, gen.token_ids, gen.logprobs)
        logprobs = self._legacy(ids, lps)
        choice = CompletionChoice(index=0, text=text, finish_reason=gen.finish_reason, logprobs=logprobs)
        return Completion(self.id, "text_completion", self.created, self.model, [choice], usage_of(gen))

    def chunk(self, piece: Piece, gen: Generation | None = None) -> msgspec.Struct:
        """One token's chunk; the first chat chunk carries the assistant role, the first completions chunk the
        echoed prompt (`gen` has its logprobs)."""
        if not self.chat:
            text, ids = piece.text, list(piece.token_ids)
            lps: list[Logprob | None] = list(piece.logprobs)
            if gen is not None:
                text, ids, lps = self._completion_parts(gen, text, ids, list(piece.logprobs))
            self._echo_pending = False
            logprobs = self._legacy(ids, lps)
            choice = CompletionChoice(index=0, text=text, finish_reason=piece.finish_reason, logprobs=logprobs)
            return Completion(self.id, "text_completion", self.created, self.model, [choice])
        delta = ChatDelta(role=None if self._role_sent else "assistant", content=piece.text)
        self._role_sent = True
        logprobs = self._chat_logprobs(list(piece.token_ids), list(piece.logprobs))
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=piece.finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def chunks(self, piece: Piece, gen: Generation | None = None) -> list[msgspec.Struct]:
        """A token's chunks: one, or with tools what the parser lets out (none while it holds a possible call,
        several when a call completes; those carry no logprobs)."""
        if self._tool_deltas is None:
            return [self.chunk(piece, gen)]
        chunks: list[msgspec.Struct] = []
        for out in self._tool_deltas.feed(piece.text, piece.finish_reason):
            delta = out.delta
            if not self._role_sent:
                delta.role = "assistant"
                self._role_sent = True
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=out.finish_reason)
            chunks.append(ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice]))
        return chunks

    def _chat_logprobs(self, ids: list[int], logprobs: list[Logprob]) -> ChatLogprobs | None:
        if self.scoring.logprobs is None or self._texts is None:
            return None
        return chat_logprobs(self._texts, ids, logprobs[: len(ids)])

    def _completion_parts(
        self, gen: Generation, text: str, ids: list[int], logprobs: list[Logprob]
    ) -> tuple[str, list[int], list[Logprob | None]]:
        """With echo (once: the whole response, or the first chunk): the prompt's text, ids and logprobs first (the
        first prompt token has none)."""
        lps: list[Logprob | None] = list(logprobs)
        if not self._echo_pending or self._texts is None:
            return text, ids, lps
        prompt_lps: list[Logprob | None] = [None, *gen.prompt_logprobs][: len(self._prompt)]
        prompt_lps += [None] * (len(self._prompt) - len(prompt_lps))
        return self._texts.decode(self._prompt) + text, self._prompt + ids, prompt_lps + lps

    def _legacy(self, ids: list[int], logprobs: list[Logprob | None]) -> CompletionLogprobs | None:
        if self.scoring.logprobs is None or self._texts is None:
            return None
        out = completion_logprobs(self._texts, ids, logprobs[: len(ids)], self._offset)
        self._offset = out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else self._offset
        return out

    def usage_chunk(self, gen: Generation) -> msgspec.Struct:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        if self.chat:
            return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage_of(gen))
        return Completion(self.id, "text_completion", self.created, self.model, [], usage_of(gen))
