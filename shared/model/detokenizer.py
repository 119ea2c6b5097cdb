"""Incremental detokenization: turn a growing list of token ids into text deltas.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens; decoding such a prefix yields
U+FFFD. The detokenizer holds text back while it ends in an incomplete character and only decodes a
short window of recent tokens per step (the prefix/read offsets), so the cost per token stays constant.
"""

from __future__ import annotations

from shared.model.tokenizer import Tokenizer

_WINDOW = 6  # tokens of context decoded with each new token, so merges at the boundary render right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already in self.text

    def add(self, token_id: int) -> str:
        """Append one token; return the newly printable text (may be empty)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._prefix : self._read], self.skip_special_tokens)
        after = decode(self.token_ids[self._prefix :], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        delta = after[len(before) :]
        self.text += delta
        self._read = len(self.token_ids)
        self._prefix = max(0, self._read - _WINDOW)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back (an incomplete character prints as U+FFFD)."""
        rest = self.tokenizer.decode(self.token_ids[self._read :], self.skip_special_tokens)
        self._read = len(self.token_ids)
        self.text += rest
        return rest
