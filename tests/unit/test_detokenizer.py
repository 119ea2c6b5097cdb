"""Incremental detokenization never prints half a character."""

from __future__ import annotations

import pytest

from services.demo_model import write_demo_checkpoint
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(write_demo_checkpoint(tmp_path_factory.mktemp("m"), arch="llama"))


def test_multibyte_characters_split_across_tokens(tokenizer):
    text = "héllo 世界 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # byte-level: one token per byte, so characters are split
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    assert deltas[1:3] == ["", "é"]  # é is two bytes: nothing, then the whole character
    assert detok.flush() == ""


def test_incomplete_tail_is_flushed_as_replacement(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("a世")
    assert detok.add(ids[0]) == "a"
    assert [detok.add(t) for t in ids[1:-1]] == ["", ""]  # the 3-byte character is held back
    assert detok.flush() == "\ufffd"


def test_special_tokens_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert "".join(detok.add(t) for t in ids) == "hi"
