"""The request fields that shape the distribution (temperature, top_p, top_k, penalties, min_p, logit_bias) and the
logprobs / echo options, checked with 400s naming the field and turned into the wire's Sampling fields, with the
defaults shared/sampling_spec.py declares. Ranges come from there too, through schemas.py (decoding refuses values
outside them); what depends on the model (logit_bias ids against the vocabulary) and on other fields (top_logprobs
needs logprobs, max_tokens 0 needs echo) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.served_model import ServedModel
from shared import sampling_spec as spec

T = TypeVar("T")

MAX_LOGIT_BIAS = 1024  # entries: each is one scatter on every step of the request
_BIAS = spec.LOGIT_BIAS.item_range or spec.Range()


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
    """The wire Sampling's fields that shape the distribution, each the declared default (shared/sampling_spec.py)
    where the request left it out; the API's top_k "off" (0 or -1) becomes the wire's null."""
    return {
        "temperature": _given(req.temperature, spec.TEMPERATURE),
        "top_p": _given(req.top_p, spec.TOP_P),
        "top_k": req.top_k if req.top_k is not None and req.top_k > 0 else spec.TOP_K.default,
        "ignore_eos": _given(req.ignore_eos, spec.IGNORE_EOS),
        "presence_penalty": _given(req.presence_penalty, spec.PRESENCE_PENALTY),
        "frequency_penalty": _given(req.frequency_penalty, spec.FREQUENCY_PENALTY),
        "repetition_penalty": _given(req.repetition_penalty, spec.REPETITION_PENALTY),
        "min_p": _given(req.min_p, spec.MIN_P),
        "logit_bias": logit_bias(req.logit_bias, model),
    }


def _given(value: T | None, field: spec.SamplingField[T]) -> T:
    return field.default if value is None else value


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
        if not _BIAS.contains(value):
            raise APIError(400, f"logit_bias values must be {_BIAS.describe()}, got {value} for {token}", "logit_bias")
        out[token] = float(value)
    return out
