"""Token ids in, client text out: incremental detokenization plus stop strings.

Invariant: text already handed out never contains the start of a stop-string match. Text that could
be the beginning of a stop string (a suffix equal to a stop string's proper prefix) is held back until
the next token decides; a stop string split across tokens is therefore caught whole and never leaks.
A character split across byte-level tokens is held back by the detokenizer (never printed as U+FFFD
unless the stream ends inside it).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded but not handed out: a possible stop-string start
        self.text = ""  # everything handed out
        self.stopped = False  # a stop string matched: the text ends before it

    def add(self, token_id: int) -> str:
        """Text this token releases (maybe ""). After a stop-string match, nothing more comes out."""
        if self.stopped:
            return ""
        return self._release(self._detok.add(token_id), final=False)

    def finish(self) -> str:
        """At the end of the stream: the held-back rest (a cut-off character prints as U+FFFD)."""
        if self.stopped:
            return ""
        return self._release(self._detok.flush(), final=True)

    def _release(self, delta: str, final: bool) -> str:
        pending = self._held + delta
        hits = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._held, self.stopped = pending[: min(hits)], "", True
        else:
            keep = 0 if final else _partial_stop(pending, self._stop)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
