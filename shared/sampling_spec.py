"""Every sampling field, declared once: its name, type, range, default and meaning.

Three consumers read this table and restate none of it: the gateway's request schema (services/gateway/schemas.py:
bounds and descriptions; prepare.py and sampling_fields.py: defaults and refusals), the wire struct
`shared.messages.Sampling` (msgspec constraints, so decoding a job enforces the ranges; shared/job_checks.py words a
worker's refusals from them) and the engine's `shared.engine.sampling.SamplingParams` (defaults and its checks).
Each consumer still spells a field's Python type where type checking needs it; tests/unit/test_sampling_spec.py
holds all three to the table field by field.

Dependency-free (the standard library only): the gateway imports it without torch, the engine without the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", covariant=True)  # a field of a narrower default is a field


@dataclass(frozen=True)
class Range:
    """An interval of numbers; a side that is None is open to infinity. Infinite and NaN values are never in it."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, … instead of [low, …
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words for an error message: "at least 1", "above 0", "in [0, 100]", "in (0, 1]"."""
        if self.high is None and self.low is not None:
            return f"{'above' if self.low_open else 'at least'} {self.low:g}"
        lo = "(" if self.low is None or self.low_open else "["
        hi = ")" if self.high is None or self.high_open else "]"
        lo_value = "-inf" if self.low is None else f"{self.low:g}"
        hi_value = "inf" if self.high is None else f"{self.high:g}"
        return f"in {lo}{lo_value}, {hi_value}{hi}"

    @property
    def ge(self) -> float | None:
        return None if self.low_open else self.low

    @property
    def gt(self) -> float | None:
        return self.low if self.low_open else None

    @property
    def le(self) -> float | None:
        return None if self.high_open else self.high

    @property
    def lt(self) -> float | None:
        return self.high if self.high_open else None


@dataclass(frozen=True)
class SamplingField(Generic[T]):
    """One field of a request's sampling. A field whose default is None is optional: None means off."""

    name: str
    kind: type  # a value's type: int, float, bool; list (token ids), dict (token id → bias), object (a spec)
    default: T
    doc: str  # what it means, as the API documents it
    range: Range | None = None  # what the wire and the engine accept; None = any value of its kind
    api_range: Range | None = None  # the OpenAI API's own range, where it differs (the gateway maps it)
    item_range: Range | None = None  # a map's values (logit_bias)
    wire_required: bool = False  # a job must state it: the wire has no default (the default is the engine's)

    @property
    def optional(self) -> bool:
        return self.default is None

    def problem(self, value: object) -> str | None:
        """Why `value` is outside this field's range, worded for a person; None when inside, or when the value is
        not a number this range speaks of (decoding checks the type)."""
        if self.range is None or value is None or not isinstance(value, int | float):
            return None
        if self.range.contains(value):
            return None
        off = " (or null for off)" if self.optional else ""
        return f"{self.name} must be {self.range.describe()}{off}, got {value}"


MAX_LOGPROBS = 20  # top alternatives per position at most (OpenAI's top_logprobs bound)
_LOGPROBS = Range(0, MAX_LOGPROBS)

MAX_TOKENS = SamplingField(
    "max_tokens",
    int,
    16,  # OpenAI's completions default; chat's is the room left in the context (the gateway's choice)
    "tokens to generate at most",
    Range(0),  # 0 = compute the prompt (its logprobs) and generate nothing
    api_range=Range(1),  # 0 only to score a prompt (completions with echo)
    wire_required=True,
)
TEMPERATURE = SamplingField(
    "temperature",
    float,
    1.0,
    "0 = greedy",
    Range(0.0, 100.0),
    api_range=Range(0.0, 2.0),  # OpenAI's range is narrower than the engine's
)
TOP_P = SamplingField(
    "top_p", float, 1.0, "keep the likeliest tokens whose probability reaches top_p", Range(0.0, 1.0, low_open=True)
)
TOP_K = SamplingField[int | None](
    "top_k",
    int,
    None,
    "0 or -1 = off",  # the API's spelling of off; the wire's is null
    Range(1),
    api_range=Range(-1),
)
SEED = SamplingField[int | None]("seed", int, None, "the draws of a seeded request repeat (keyed by output position)")
STOP_TOKEN_IDS = SamplingField[tuple[int, ...]]("stop_token_ids", list, (), "token ids that end the output")
IGNORE_EOS = SamplingField("ignore_eos", bool, False, "generate past the end-of-sequence token")
PRESENCE_PENALTY = SamplingField(
    "presence_penalty", float, 0.0, "once for every token generated so far", Range(-2.0, 2.0)
)
FREQUENCY_PENALTY = SamplingField(
    "frequency_penalty", float, 0.0, "times each token's count in the tokens generated so far", Range(-2.0, 2.0)
)
REPETITION_PENALTY = SamplingField(
    "repetition_penalty", float, 1.0, "over prompt and generated tokens; 1 = off", Range(0.0, low_open=True)
)
MIN_P = SamplingField(
    "min_p", float, 0.0, "drop tokens below min_p times the top probability; 0 = off", Range(0.0, 1.0)
)
LOGIT_BIAS = SamplingField[tuple[tuple[int, float], ...]](
    "logit_bias", dict, (), "token id → bias added to its logit", item_range=Range(-100.0, 100.0)
)
LOGPROBS = SamplingField[int | None](
    "logprobs", int, None, "per generated token: its logprob and this many top alternatives", _LOGPROBS
)
PROMPT_LOGPROBS = SamplingField[int | None](
    "prompt_logprobs",
    int,
    None,
    "per prompt token (from the second): its logprob and this many alternatives",
    _LOGPROBS,
)
STRUCTURED = SamplingField[object]("structured", object, None, "a StructuredSpec the output must match")

# In the wire's and the engine's order.
SAMPLING_FIELDS: tuple[SamplingField[object], ...] = (
    MAX_TOKENS,
    TEMPERATURE,
    TOP_P,
    TOP_K,
    SEED,
    STOP_TOKEN_IDS,
    IGNORE_EOS,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
    MIN_P,
    LOGIT_BIAS,
    LOGPROBS,
    PROMPT_LOGPROBS,
    STRUCTURED,
)
