"""The request fields that shape the distribution beyond temperature / top_p / top_k (penalties, min_p,
logit_bias) and the logprobs / echo options, checked with 400s naming the field and turned into the wire's
Sampling fields. Ranges are declared in schemas.py (decoding refuses values outside them); what depends on the
model (logit_bias ids against the vocabulary) and on other fields (top_logprobs needs logprobs, max_tokens 0 needs
echo) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.served_model import ServedModel

MAX_LOGIT_BIAS = 1024  # entries: each is one scatter on every step of the request


@dataclass(frozen=True)
class Scoring:
    """What a request asks for besides its tokens: logprobs per generated token (None = none, else how many
    alternatives), the prompt's logprobs (completions with echo and logprobs), the prompt's text echoed."""

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False


def chat_scoring(req: ChatCompletionRequest) -> Scoring:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return Scoring(logprobs=(req.top_logprobs or 0) if req.logprobs else None)


def completion_scoring(req: CompletionRequest) -> Scoring:
    echo = bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens may be 0 only with echo: true (to score the prompt)", "max_tokens")
    if req.max_tokens == 0 and (req.n or 1) > 1:  # n identical scorings: ask once
        raise APIError(400, "max_tokens 0 scores the prompt once: n must be 1", "n")
    return Scoring(logprobs=req.logprobs, prompt_logprobs=req.logprobs if echo else None, echo=echo)


def distribution_fields(req: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> dict[str, Any]:
    """The wire Sampling's penalty, min_p and logit_bias fields (defaults where the request left them out)."""
    return {
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "min_p": req.min_p or 0.0,
        "logit_bias": logit_bias(req.logit_bias, model),
    }


def logit_bias(bias: dict[str, float] | None, model: ServedModel) -> dict[int, float]:
    """OpenAI's map of token ids (JSON keys, so strings) to biases in [-100, 100], with the ids as ints."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias") from None
        if not 0 <= token < model.vocab_size:
            raise APIError(
                400, f"logit_bias token id {token} is outside the vocabulary [0, {model.vocab_size})", "logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for {token}", "logit_bias")
        out[token] = float(value)
    return out
