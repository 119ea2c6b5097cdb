"""Prompt and completion text in the gateway's log: only with settings.log_prompts (default off), for
debugging, because prompts and what the model answers are user data.

The texts are written JSON-quoted, so a newline or a control character in a prompt cannot forge log lines.
Nothing else in pdserve writes prompt or completion text, or their token ids, to a log (docs/security.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from shared.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def log_prompt(request_id: str, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
    """The prompt as the model sees it (the chat template applied, special tokens kept)."""
    text = tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False)
    log.info("request %s prompt (%d tokens): %s", request_id, len(prompt_token_ids), _quoted(text))


def log_completion(request_id: str, text: str, tokens: int, ending: str) -> None:
    """What the client was sent, and how the request ended (finish reason, error, abort)."""
    log.info("request %s completion (%d tokens, %s): %s", request_id, tokens, ending, _quoted(text))


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
