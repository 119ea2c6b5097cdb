"""Logprobs as the APIs show them: chat's `logprobs.content[]` (token, logprob, bytes, top_logprobs[]) and the
legacy completions shape (tokens, token_logprobs, top_logprobs as {token: logprob}, text_offset), whole or per
chunk. A token's text is its own decoding; its bytes are its raw bytes (a byte-level token that is half of a
UTF-8 character has bytes, and U+FFFD as its text, as OpenAI shows it).
"""

from __future__ import annotations

from functools import lru_cache

from services.gateway.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from shared.messages import Logprob
from shared.model.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others are shifted to
    code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Per-token text and bytes of one tokenizer, cached by id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.id_to_token(token_id) or ""
            chars = _byte_level_chars()
            raw = [chars[c] for c in piece] if piece and all(c in chars for c in piece) else list(text.encode())
            hit = self._cache[token_id] = (text, raw)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def decode(self, token_ids: list[int]) -> str:
        """A run of tokens as the client's text (an echoed prompt)."""
        return self._tokenizer.decode(token_ids)


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[Logprob]) -> ChatLogprobs:
    content = []  # a worker that sent no logprobs for some token (none should) leaves those out, not a 500
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        text, raw = texts.get(token_id)
        top = [_top(texts, t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(text, lp.logprob, raw, top))
    return ChatLogprobs(content=content)


def _top(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    text, raw = texts.get(token_id)
    return TopLogprob(text, logprob, raw)


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    logprobs: list[Logprob | None],
    offset: int = 0,
) -> CompletionLogprobs:
    """The legacy shape; `logprobs[i]` None = the first prompt token (no logprob); text offsets start at `offset`
    (the characters of the choice's text before these tokens)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=False):  # as chat_logprobs: never a 500 for a gap
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if lp is None else lp.logprob)
        tops.append(
            None if lp is None else {texts.text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        )
    return CompletionLogprobs(tokens, values, tops, offsets)
