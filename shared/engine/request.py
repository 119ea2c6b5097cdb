"""One request's state inside an engine."""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum

from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"  # queued; also where a preempted request returns to
    RUNNING = "running"  # has KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # a stop token (EOS unless ignore_eos, or one of stop_token_ids)
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass
class GroupTable:
    """A request's blocks in one KV cache group: entry i holds positions i*B..; the first `freed` entries were
    given back behind the group's sliding window (FREED, scheduler.py)."""

    blocks: list[int] = field(default_factory=list)
    freed: int = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Keep the KV blocks when the request finishes, until the engine is told to release them
    # (a prefill worker holds them for the decode worker's pull).
    hold_kv: bool = False
    # Salt of its prefix-cache hashes (shared/prefix_hash.py request_salt): it only hits blocks of the same salt.
    cache_salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Per KV cache group (shared/engine/kv_groups.py; one unless full and sliding layers mix): its block table
    group_tables: list[GroupTable] = field(default_factory=lambda: [GroupTable()])
    # Tokens (prompt + output) whose K/V is in the cache. A request is decoding once this is
    # num_tokens - 1: only the last sampled token still has to go through the model.
    num_computed_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Wall clock (time.time()) when the engine first gave it compute (or imported its KV): the end of its
    # queue wait. Kept across preemptions.
    scheduled_at: float | None = None
    # params.prompt_logprobs: those of prompt positions 1.. computed so far (across prefill chunks), and whether
    # an output carried them yet
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Prefix caching (shared/engine/prefix_caching.py): prompt tokens found cached when first admitted (0: a miss,
    # or caching off); the prefix hashes of its leading full blocks, computed as far as needed; and how many of
    # its leading blocks were offered to the cache (0 again when its blocks are released).
    num_cached_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    blocks_offered: int = 0

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table: the only one of a one-group model; the full layers' of a hybrid one."""
        return self.group_tables[0].blocks

    @block_table.setter
    def block_table(self, blocks: list[int]) -> None:
        self.group_tables[0].blocks = blocks

    @property
    def window_freed(self) -> int:
        return self.group_tables[0].freed

    @window_freed.setter
    def window_freed(self, n: int) -> None:
        self.group_tables[0].freed = n

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class PromptLimits:
    """What an engine takes in: token ids below `vocab_size`, fewer tokens than `max_model_len` (one more must
    fit), and a request id no live request has."""

    max_model_len: int
    vocab_size: int

    def check(self, live: Container[str], request_id: str, tokens: list[int]) -> None:
        """ValueError for a duplicate id (in `live`), no tokens, too many, or one out of the vocabulary."""
        if request_id in live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
