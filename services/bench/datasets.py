"""Benchmark workloads: lists of BenchRequest built from random tokens, a ShareGPT file, or the interference mix.

Every builder is deterministic for a given seed and tokenizer. Token counts come from the tokenizer passed in,
which should be the served model's (`--tokenizer DIR`), so prompt lengths mean what the server will see.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.bench.arrivals import arrivals_until, check_rate
from services.bench.prompts import PromptMaker, Tokenizer

__all__ = [
    "BenchRequest",
    "Tokenizer",
    "interference_requests",
    "length_range",
    "random_requests",
    "sharegpt_requests",
]

MIN_SHAREGPT_LEN = 4  # vLLM's min_len: shorter prompts or completions are skipped
HUMAN_ROLES = frozenset({"human", "user"})
NOT_ANSWERS = HUMAN_ROLES | {"system"}


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. For the chat endpoint `prompt` becomes one user message (the chat template then adds
    tokens: the server's count, from its usage chunk, is what the results report). A request with a shared
    `prefix` sends it before `prompt`: prepended to the completions prompt, or as the chat system message."""

    prompt: str
    prompt_len: int  # tokens, as counted by the tokenizer used to build it (prefix included)
    output_len: int  # max_tokens asked for; sent with ignore_eos so the server produces exactly this many
    kind: str = "default"  # workload class ("stream" / "long" in the interference mix), reported separately
    at_s: float | None = None  # fixed send time, s from the run's start; None: the arrival process decides
    prefix: str = ""  # text shared with other requests (services.bench.prefix_workloads)
    prefix_len: int = 0  # its tokens, part of prompt_len

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.at_s is not None and not self.at_s >= 0:
            raise ValueError(f"at_s must be >= 0, got {self.at_s}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be within [0, prompt_len], got {self.prefix_len}")


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths around `length`, as vLLM's random dataset draws them:
    floor(length·(1−r)) .. ceil(length·(1+r)), never below 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def random_requests(
    tokenizer: Tokenizer,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    kind: str = "default",
) -> list[BenchRequest]:
    """`num` requests of random tokens, like `vllm bench serve --dataset-name random`: input and output lengths
    uniform over the integers of length_range(len, range_ratio). prompt_len is the prompt's real token count (see
    services.bench.prompts for what is guaranteed: the target, or in rare BPE cases the closest length reached)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=num).tolist()
    maker = PromptMaker(tokenizer)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        text, real = maker.make(n_in, rng)
        requests.append(BenchRequest(text, real, n_out, kind))
    return requests


def sharegpt_requests(
    path: str | Path,
    tokenizer: Tokenizer,
    num: int,
    seed: int = 0,
    output_len: int | None = None,
    max_input_len: int = 1024,
    max_output_len: int = 2048,
    *,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """`num` requests from a ShareGPT JSON file: a list of {"id", "conversations": [{"from", "value"}, ...]}.

    The prompt is the first human turn, output_len the token length of the reply that follows it (or `output_len`
    for all). Like vLLM, entries are shuffled with `seed` and skipped when they have no such pair, when the prompt
    has fewer than 4 tokens or more than max_input_len, when the reply (measured, not overridden) has fewer than
    4, or when it is over max_output_len or prompt + reply is over max_total_len. When fewer than `num` entries
    pass, the passing ones are drawn again at random to make up the number (vLLM oversamples the same way).
    Raises ValueError when the file is not that format or no entry passes.
    """
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    entries = _read_sharegpt(Path(path))
    order = list(range(len(entries)))
    rnd = random.Random(seed)
    rnd.shuffle(order)
    picked: list[BenchRequest] = []
    for i in order:
        pair = _first_exchange(entries[i]["conversations"])
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = len(tokenizer.encode(reply)) if output_len is None else output_len
        too_short = prompt_len < MIN_SHAREGPT_LEN or (output_len is None and reply_len < MIN_SHAREGPT_LEN)
        too_long = prompt_len > max_input_len or reply_len > max_output_len or prompt_len + reply_len > max_total_len
        if too_short or too_long:
            continue
        picked.append(BenchRequest(prompt, prompt_len, reply_len))
        if len(picked) == num:
            return picked
    if not picked:
        raise ValueError(f"{path}: no conversation passes the length filters (prompt 4..{max_input_len} tokens)")
    return picked + [rnd.choice(picked) for _ in range(num - len(picked))]


def _read_sharegpt(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); expected a ShareGPT list of conversations") from exc
    expected = 'expected a JSON list of {"id", "conversations": [{"from", "value"}, ...]} objects'
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: not a ShareGPT file: {expected}")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise ValueError(f"{path}: entry {i} has no 'conversations' list: {expected}")
    return data


def _first_exchange(turns: list) -> tuple[str, str] | None:
    """(first human turn, the reply right after it), or None when there is no such pair."""
    for i, turn in enumerate(turns[:-1]):
        if _is_turn(turn) and turn["from"] in HUMAN_ROLES:
            reply = turns[i + 1]
            if _is_turn(reply) and reply["from"] not in NOT_ANSWERS:
                return turn["value"], reply["value"]
            return None
    return None


def _is_turn(turn: object) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)


def interference_requests(
    tokenizer: Tokenizer,
    duration_s: float,
    stream_rate: float,
    stream_input_len: int,
    stream_output_len: int,
    long_interval_s: float,
    long_input_len: int,
    long_output_len: int,
    seed: int = 0,
    burstiness: float = 1.0,
) -> list[BenchRequest]:
    """The interference workload: steady decode-heavy "stream" requests arriving as a gamma process (Poisson at
    burstiness 1) at `stream_rate` req/s over [0, duration_s), plus a "long" prompt at long_interval_s/2, then every
    long_interval_s. Every request carries at_s; the list is sorted by it.

    In a colocated server each long prefill stalls the decode steps of every running stream; a disaggregated one
    keeps stream TPOT flat. Compare the "stream" kind's TPOT/ITL percentiles between the two.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    if not long_interval_s > 0:
        raise ValueError(f"long_interval_s must be positive, got {long_interval_s}")
    check_rate(stream_rate, burstiness)
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer)
    timed: list[tuple[float, str, int, int]] = [
        (t, "stream", stream_input_len, stream_output_len)
        for t in arrivals_until(duration_s, stream_rate, burstiness, rng)
    ]
    k = 0
    while (at_s := (k + 0.5) * long_interval_s) < duration_s:
        timed.append((at_s, "long", long_input_len, long_output_len))
        k += 1
    timed.sort(key=lambda item: item[0])  # stable: a tie keeps the stream request first
    requests = []
    for at_s, kind, n_in, n_out in timed:
        text, real = maker.make(n_in, rng)
        requests.append(BenchRequest(text, real, n_out, kind, at_s))
    return requests
