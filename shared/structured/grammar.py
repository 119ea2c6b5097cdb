"""The grammar engine (llguidance; benchmarks/grammar_bench.py and docs/api.md say why): specs compiled against
one tokenizer, with a cache, into matchers that give each step's allowed-token bitmask.

A matcher follows one request's output: `accept` every token sampled under it (or replayed, after a hand-off or
a migration: `Grammars.matcher(spec, tokens)`), `fill_masks` writes the next step's bits for a batch of them.
EOS is allowed exactly when the grammar accepts what was written; once nothing else can follow, only EOS is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance

from shared.structured.spec import StructuredKind, StructuredSpec

if TYPE_CHECKING:  # declared in llguidance's stubs only
    from llguidance._lib import JsonCompileOptions
    from numpy.typing import ArrayLike

_CACHE_SIZE = 256  # compiled grammars kept per tokenizer (the same schema sent again compiles once)


# JSON written as json.dumps writes it ("a, b", "k: v"), no free whitespace: a model cannot pad forever, and the
# same value always comes out as the same text
_JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


class GrammarError(ValueError):
    """The spec is not a valid JSON Schema / regex / grammar; the message says what is wrong."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (one bit per token id)."""
    return (vocab_size + 31) // 32


class Grammars:
    """Compiles specs for one tokenizer. `vocab_size` is the model's (its logits' width, at least the
    tokenizer's); ids past the tokenizer's are never allowed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compile = lru_cache(maxsize=_CACHE_SIZE)(self._compile_uncached)
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"{model_dir}: no tokenizer.json, so no structured output")
        return cls(path.read_text(), vocab_size, eos_token_ids)

    def check(self, spec: StructuredSpec) -> None:
        """Raises GrammarError naming what is wrong; compiles (and caches) the spec."""
        self._compile(spec)

    def matcher(self, spec: StructuredSpec, tokens: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, advanced over `tokens` (the output so far). Raises GrammarError when the
        spec is invalid or the tokens do not follow it."""
        m = llguidance.LLMatcher(self.tokenizer, self._compile(spec), log_level=0)
        if tokens and not m.consume_tokens(list(tokens)):
            raise GrammarError(f"the output so far does not follow the grammar: {m.get_error()}")
        return m

    def _compile_uncached(self, spec: StructuredSpec) -> str:
        grammar = _grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)
        return grammar

    def fill_masks(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: ArrayLike) -> None:
        """Write row i of `bitmask` (int32, (N, bitmask_words), CPU, contiguous: the engine's torch tensor, viewed
        in place as an array) for each (matcher, i), in llguidance's threads (the GIL is released: the caller may
        run this in a thread of its own)."""
        # numpy's variant, imported here: only the engine fills masks, and the gateway (which compiles grammars
        # too) loads neither torch nor numpy for it
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, matchers, np.asarray(bitmask))


def _grammar_text(spec: StructuredSpec) -> str:
    m = llguidance.LLMatcher
    if spec.kind is StructuredKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from exc
        if schema is False:
            raise GrammarError("the schema `false` allows no output at all")
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON Schema is an object (or true)")
        try:
            return m.grammar_from_json_schema("{}" if schema is True else spec.spec, defaults=_JSON_LAYOUT)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
    if spec.kind is StructuredKind.REGEX:
        return m.grammar_from_regex(spec.spec)
    return m.grammar_from_lark(spec.spec)
