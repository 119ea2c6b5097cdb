"""The one model a gateway serves: its client-facing name, tokenizer and context length.

Loaded once at start from the checkpoint directory (config.json, tokenizer.json, chat template);
no weights are read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in `model`; also the job subject's model token
    tokenizer: Tokenizer
    max_model_len: int  # prompt + generated tokens, at most
    vocab_size: int  # token ids a client may send are in [0, vocab_size)
    created: int  # unix time the gateway loaded it (GET /v1/models)

    @classmethod
    def load(cls, settings: GatewaySettings) -> ServedModel:
        config = ModelConfig.from_dir(settings.model)
        tokenizer = Tokenizer(settings.model)
        return cls(
            name=settings.served_model_name,
            tokenizer=tokenizer,
            max_model_len=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            created=int(time.time()),
        )
