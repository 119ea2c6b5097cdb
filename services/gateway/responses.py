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
    PromptTokensDetails,
    Usage,
)
from services.gateway.tools.output import ToolDeltas, tool_message
from services.gateway.tools.parsers import ToolParser
from shared.messages import Logprob
from shared.model.tokenizer import Tokenizer


def new_request_id(chat: bool) -> str:
    """Unique, and safe as a NATS subject token (letters, digits, '-')."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage_of(gen: Generation | ChoiceSet) -> Usage:
    """As OpenAI counts: the prompt once, the completion tokens of every choice; of the prompt, the tokens the
    prefix cache served."""
    total = gen.prompt_tokens + gen.completion_tokens
    return Usage(gen.prompt_tokens, gen.completion_tokens, total, PromptTokensDetails(gen.cached_tokens))


class ResponseWriter:
    """Per-choice state (keyed by the choice's index): whether its role went out, its tool-call parser, whether
    its echoed prompt went out, and how much of its text the legacy logprobs' offsets have covered."""

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
        self._role_sent: set[int] = set()  # choices whose first chat chunk (with the role) went out
        self.tool_parser = tool_parser  # chat with tools: text is read back into tool_calls (tools/output.py)
        self._tool_deltas: dict[int, ToolDeltas] = {}  # choice index → its streaming parser, made on first use
        self.scoring = scoring or Scoring()
        self._texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._prompt = list(prompt_token_ids or [])
        self._echoed: set[int] = set()  # choices whose text already began with the echoed prompt
        self._offsets: dict[int, int] = {}  # completions with logprobs: characters of each choice's text so far

    def whole(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The non-streaming response, after gen (one choice, or n) ran to its end."""
        gens = gen.gens if isinstance(gen, ChoiceSet) else [gen]
        if self.chat:
            choices = [self._chat_choice(i, g) for i, g in enumerate(gens)]
            return ChatCompletion(self.id, "chat.completion", self.created, self.model, choices, usage_of(gen))
        texts = []
        for i, g in enumerate(gens):
            text, ids, lps = self._completion_parts(i, g, g.text.text, g.token_ids, g.logprobs)
            logprobs = self._legacy(i, ids, lps)
            texts.append(CompletionChoice(index=i, text=text, finish_reason=g.finish_reason, logprobs=logprobs))
        return Completion(self.id, "text_completion", self.created, self.model, texts, usage_of(gen))

    def _chat_choice(self, index: int, gen: Generation) -> ChatChoice:
        message = AssistantMessage(role="assistant", refusal=None, content=gen.text.text)
        finish_reason = gen.finish_reason
        if self.tool_parser is not None:
            message, finish_reason = tool_message(gen.text.text, self.tool_parser, finish_reason)
        logprobs = self._chat_logprobs(gen.token_ids, gen.logprobs)
        return ChatChoice(index=index, message=message, finish_reason=finish_reason, logprobs=logprobs)

    def chunk(self, piece: Piece, gen: Generation | None = None, index: int = 0) -> msgspec.Struct:
        """One token's chunk of choice `index`; each choice's first chat chunk carries the assistant role, its
        first completions chunk the echoed prompt (`gen`, that choice's generation, has its logprobs)."""
        if not self.chat:
            text, ids = piece.text, list(piece.token_ids)
            lps: list[Logprob | None] = list(piece.logprobs)
            if gen is not None:
                text, ids, lps = self._completion_parts(index, gen, text, ids, list(piece.logprobs))
            logprobs = self._legacy(index, ids, lps)
            choice = CompletionChoice(index=index, text=text, finish_reason=piece.finish_reason, logprobs=logprobs)
            return Completion(self.id, "text_completion", self.created, self.model, [choice])
        delta = ChatDelta(role=None if index in self._role_sent else "assistant", content=piece.text)
        self._role_sent.add(index)
        logprobs = self._chat_logprobs(list(piece.token_ids), list(piece.logprobs))
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=piece.finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def chunks(self, piece: Piece, gen: Generation | None = None, index: int = 0) -> list[msgspec.Struct]:
        """A token's chunks of choice `index`: one, or with tools what that choice's parser lets out (none while
        it holds a possible call, several when a call completes; those carry no logprobs)."""
        if self.tool_parser is None:
            return [self.chunk(piece, gen, index)]
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

    def _chat_logprobs(self, ids: list[int], logprobs: list[Logprob]) -> ChatLogprobs | None:
        if self.scoring.logprobs is None or self._texts is None:
            return None
        return chat_logprobs(self._texts, ids, logprobs[: len(ids)])

    def _completion_parts(
        self, index: int, gen: Generation, text: str, ids: list[int], logprobs: list[Logprob]
    ) -> tuple[str, list[int], list[Logprob | None]]:
        """With echo (once per choice: its whole response, or its first chunk): the prompt's text, ids and
        logprobs first (the first prompt token has none)."""
        lps: list[Logprob | None] = list(logprobs)
        if not self.scoring.echo or index in self._echoed or self._texts is None:
            return text, ids, lps
        self._echoed.add(index)
        prompt_lps: list[Logprob | None] = [None, *gen.prompt_logprobs][: len(self._prompt)]
        prompt_lps += [None] * (len(self._prompt) - len(prompt_lps))
        return self._texts.decode(self._prompt) + text, self._prompt + ids, prompt_lps + lps

    def _legacy(self, index: int, ids: list[int], logprobs: list[Logprob | None]) -> CompletionLogprobs | None:
        if self.scoring.logprobs is None or self._texts is None:
            return None
        out = completion_logprobs(self._texts, ids, logprobs[: len(ids)], self._offsets.get(index, 0))
        if out.tokens:
            self._offsets[index] = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def usage_chunk(self, gen: Generation | ChoiceSet) -> msgspec.Struct:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        if self.chat:
            return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage_of(gen))
        return Completion(self.id, "text_completion", self.created, self.model, [], usage_of(gen))
