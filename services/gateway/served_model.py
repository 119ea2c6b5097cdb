"""The one model a gateway serves: its client-facing name, tokenizer and context length, with the limits on
the prompts clients may send it and whether their text is logged.

Loaded once at start from the checkpoint directory (config.json, tokenizer.json, chat template) and the
gateway's settings; no weights are read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings
from shared.structured.grammar import Grammars


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in `model`; also the job subject's model token
    tokenizer: Tokenizer
    max_model_len: int  # prompt + generated tokens, at most
    vocab_size: int  # token ids a client may send are in [0, vocab_size)
    created: int  # unix time the gateway loaded it (GET /v1/models)
    max_prompt_tokens: int  # the longest prompt accepted: settings.max_prompt_tokens within the context
    max_prompt_chars: int  # text longer than this cannot fit in max_prompt_tokens: refused without tokenizing
    log_prompts: bool = False  # settings.log_prompts: requests' prompt and completion text in the log
    tool_call_parser: str = "auto"  # settings.tool_call_parser

    @cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler for this tokenizer (built on first use; caches compiled specs)."""
        return Grammars(self.tokenizer.to_json(), self.vocab_size, self.tokenizer.eos_token_ids)

    @classmethod
    def load(cls, settings: GatewaySettings) -> ServedModel:
        config = ModelConfig.from_dir(settings.model)
        tokenizer = Tokenizer(settings.model)
        context = config.max_position_embeddings
        # A prompt leaves room for at least one generated token.
        max_prompt_tokens = min(settings.max_prompt_tokens or context - 1, context - 1)
        return cls(
            name=settings.served_model_name,
            tokenizer=tokenizer,
            max_model_len=context,
            vocab_size=config.vocab_size,
            created=int(time.time()),
            max_prompt_tokens=max_prompt_tokens,
            max_prompt_chars=max_prompt_tokens * _longest_token_chars(tokenizer),
            log_prompts=settings.log_prompts,
            tool_call_parser=str(settings.tool_call_parser),
        )


def _longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token stands for, bounded by its longest vocabulary entry: byte-level
    entries spell one character per byte (a byte covers at most one character of text), byte-fallback and
    special tokens are longer than what they cover. So n tokens never cover more than n times this many
    characters, and a longer text needs more tokens (tokenizing it only to learn that costs seconds of the
    gateway's event loop per megabyte)."""
    return max(1, max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)))
