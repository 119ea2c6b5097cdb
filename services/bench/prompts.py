"""Random prompts of an exact token length: random token ids decoded to text, re-encoded, then trimmed or extended
until the text's own token count is the target.

Decoded ids do not always re-encode to as many ids: BPE merges neighbours, and a byte-level token alone may be half
a UTF-8 character. Ids are therefore drawn only from those that decode to a non-empty, printable string (no U+FFFD,
no control characters) and re-encode to themselves (checked lazily, cached), and the text is adjusted by the
difference a few times.

What is guaranteed: the returned length is always the real count, len(tokenizer.encode(text)) — what the server
will see for a completions prompt. It equals the target whenever an adjustment reaches it (every time with the
byte-level demo tokenizers; nearly always with BPE vocabularies); otherwise the closest length seen is returned,
which in practice is within ±1 of the target.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

MAX_ADJUSTMENTS = 16
MAX_DRAWS_PER_ID = 10_000  # give up on a vocabulary where nothing round-trips


class Tokenizer(Protocol):
    """What the datasets need: shared.model.tokenizer.Tokenizer and Hugging Face tokenizers both qualify
    (random prompts also need `vocab_size`)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class PromptMaker:
    """Makes random prompts for one tokenizer; keeps the cache of ids known to round-trip alone."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError("random prompts need a tokenizer with a positive integer `vocab_size`")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # Tokens the tokenizer adds around any text (a BOS, say): part of every count, never drawn.
        self.overhead = len(tokenizer.encode(""))
        self._ok: dict[int, bool] = {}

    def _round_trips(self, token_id: int) -> bool:
        ok = self._ok.get(token_id)
        if ok is None:
            text = self.tokenizer.decode([token_id])
            ids = self.tokenizer.encode(text) if _readable(text) else []
            ok = self._ok[token_id] = len(ids) == self.overhead + 1 and token_id in ids
        return ok

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        """n ids, uniform over the ids that round-trip alone."""
        out: list[int] = []
        draws = 0
        while len(out) < n:
            for token_id in rng.integers(0, self.vocab_size, size=max(8, 2 * (n - len(out)))).tolist():
                draws += 1
                if self._round_trips(token_id):
                    out.append(token_id)
                    if len(out) == n:
                        break
            if not out and draws > MAX_DRAWS_PER_ID:
                raise ValueError("no token of this vocabulary decodes to text that re-encodes to itself")
        return out

    def make(self, target: int, rng: np.random.Generator) -> tuple[str, int]:
        """A prompt of `target` tokens as the tokenizer counts them: (text, real token count)."""
        if target < 1:
            raise ValueError(f"prompt length must be >= 1, got {target}")
        ids = self.draw(max(1, target - self.overhead), rng)
        best: tuple[int, str, int] | None = None  # (distance, text, count)
        for _ in range(MAX_ADJUSTMENTS):
            text = self.tokenizer.decode(ids)
            count = len(self.tokenizer.encode(text))
            if best is None or abs(count - target) < best[0]:
                best = (abs(count - target), text, count)
            if count == target:
                break
            if count < target:  # merges ate some tokens: add fresh ones
                ids = ids + self.draw(target - count, rng)
            elif len(ids) > 1:  # more tokens than ids (rare): drop ids from the end
                ids = ids[: max(1, len(ids) - (count - target))]
            else:
                break
        assert best is not None
        return best[1], best[2]


def _readable(text: str) -> bool:
    """Non-empty, and every character printable or ordinary whitespace: no U+FFFD (half a UTF-8 character), no
    control characters that some servers or terminals mishandle."""
    return bool(text) and "\ufffd" not in text and all(c.isprintable() or c in " \t\n" for c in text)
