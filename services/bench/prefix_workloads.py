"""Workloads whose prompts share prefixes, to measure prefix caching and cache-aware routing.

- shared-prefix (after SGLang's generated-shared-prefix dataset): `num_groups` random prefixes of `prefix_len`
  tokens (a long system prompt, a few-shot block, a document); each request is its group's prefix followed by a
  random suffix of `suffix_len` tokens of its own. The groups are interleaved at random in send order, as users of
  several applications would be. The completions endpoint sends prefix + suffix as one prompt; chat sends the
  prefix as the system message and the suffix as the user message.
- multi-turn: conversations of `num_turns` turns; turn k sends every earlier user message with the model's actual
  answer to it (streamed back during the run), then a new user message. The answers exist only at run time, so a
  Conversation holds the user messages and the runner (services.bench.runner) builds each turn's history.

A cache can reuse a prefix only if it is the same tokens every time. Prefix and suffix are drawn separately, so at
their boundary a merging tokenizer could join the prefix's last token with the suffix's first; each suffix is
checked (the prefix's own tokens must open the whole prompt's) and drawn again if it does not keep them.
Deterministic for a given seed and tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.bench.datasets import BenchRequest
from services.bench.prompts import PromptMaker, Tokenizer

__all__ = ["Conversation", "multi_turn_conversations", "prompt_share", "shared_prefix_requests"]

MAX_SUFFIX_DRAWS = 16  # suffixes tried per request before the tokenizer is declared unable to keep a prefix


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another: turn k (k ≥ 1) is sent think_s seconds after turn k−1's stream ended, with
    the earlier user messages and the answers the server streamed for them as its history. Each turn's `prompt`
    is only its new user message, and its `prompt_len` that message's tokens (the server's usage count, history
    included, is what the results report). at_s: the first turn's send time, as BenchRequest.at_s."""

    turns: tuple[BenchRequest, ...]
    think_s: float = 0.0
    at_s: float | None = None

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("a conversation needs at least one turn")
        if any(t.at_s is not None for t in self.turns):
            raise ValueError("a conversation's turns have no send times of their own: set Conversation.at_s")
        if not self.think_s >= 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")
        if self.at_s is not None and not self.at_s >= 0:
            raise ValueError(f"at_s must be >= 0, got {self.at_s}")


def shared_prefix_requests(
    tokenizer: Tokenizer,
    num_groups: int,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests spread evenly over `num_groups` shared prefixes (the first num_prompts % num_groups
    groups get one more), in a seeded random order. Each request's `prefix` is its group's text, `prefix_len` its
    token count, `prompt` the suffix and `prompt_len` the count of prefix + suffix as one completions prompt.
    Raises ValueError for fewer prompts than groups, or a tokenizer that keeps merging the prefix into the
    suffix."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if num_prompts < num_groups:
        raise ValueError(f"num_prompts ({num_prompts}) must be at least num_groups ({num_groups})")
    if suffix_len < 1:
        raise ValueError(f"suffix_len must be >= 1, got {suffix_len}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer)
    prefixes = [maker.make(prefix_len, rng)[0] for _ in range(num_groups)]
    prefix_ids = [tokenizer.encode(p) for p in prefixes]
    order = np.arange(num_prompts) % num_groups
    rng.shuffle(order)
    requests = []
    for g in order.tolist():
        suffix, total = _suffix_keeping(maker, prefixes[g], prefix_ids[g], suffix_len, rng)
        requests.append(BenchRequest(suffix, total, output_len, prefix=prefixes[g], prefix_len=len(prefix_ids[g])))
    return requests


def _suffix_keeping(
    maker: PromptMaker, prefix: str, prefix_ids: list[int], suffix_len: int, rng: np.random.Generator
) -> tuple[str, int]:
    """A random suffix of about suffix_len tokens after which `prefix` still encodes to prefix_ids: (text, token
    count of prefix + suffix)."""
    for _ in range(MAX_SUFFIX_DRAWS):
        suffix, _ = maker.make(suffix_len + maker.overhead, rng)  # overhead (a BOS) is counted once, in the prefix
        ids = maker.tokenizer.encode(prefix + suffix)
        if ids[: len(prefix_ids)] == prefix_ids:
            return suffix, len(ids)
    raise ValueError(f"the tokenizer merged the shared prefix into {MAX_SUFFIX_DRAWS} suffixes in a row")


def prompt_share(requests: list[BenchRequest]) -> float | None:
    """Shared prefix tokens / prompt tokens over the requests (the most a prefix cache can save), None without a
    prompt token."""
    total = sum(r.prompt_len for r in requests)
    return sum(r.prefix_len for r in requests) / total if total else None


def multi_turn_conversations(
    tokenizer: Tokenizer,
    num_conversations: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    think_s: float = 0.0,
    seed: int = 0,
) -> list[Conversation]:
    """`num_conversations` conversations of `num_turns` turns; every turn's new user message is `input_len` random
    tokens and asks for `output_len` tokens. All turns have kind "multi-turn"; the runner numbers them."""
    if num_conversations < 1:
        raise ValueError(f"num_conversations must be >= 1, got {num_conversations}")
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer)
    conversations = []
    for _ in range(num_conversations):
        turns = []
        for _ in range(num_turns):
            text, real = maker.make(input_len, rng)
            turns.append(BenchRequest(text, real, output_len, kind="multi-turn"))
        conversations.append(Conversation(tuple(turns), think_s))
    return conversations
