"""What the event loop knows of the engine's load: an immutable snapshot the ENGINE THREAD takes after every
command and every step (AsyncEngine's on_state hook), so the loop never reads counters the engine thread is
changing. Admission (`has_room`) and heartbeats read only the latest snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.dp_blocks import DpBlockManager
from shared.engine.engine import Engine
from shared.engine.prefix_caching import PrefixCacheStats

# Fetch no job once this share of the KV blocks is in use: what remains is for the running requests to grow.
MAX_BLOCK_USAGE = 0.9


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    waiting_tokens: int  # tokens the queued requests still need computed
    free_blocks: int  # KV cache group 0's (the full layers'; a one-group model's only group)
    total_blocks: int
    prefill_tokens: int  # cumulative (EngineStats)
    decode_tokens: int
    requests: frozenset[str]  # ids the engine knows: running, waiting, or finished and holding KV
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    # every KV cache group's, group 0 first (shared/engine/kv_groups.py: gpt-oss's full layers, then one group
    # per sliding window); a one-group model: (free_blocks,) and (total_blocks,)
    group_free_blocks: tuple[int, ...] = ()
    group_total_blocks: tuple[int, ...] = ()
    prefix_cache: PrefixCacheStats = PrefixCacheStats()  # cumulative; zeros with prefix caching off
    # data-parallel attention (--dp-attention): per DP rank its running sequences and free blocks (a request's
    # blocks all lie on one rank: shared/engine/dp_blocks.py); empty otherwise
    dp_running: tuple[int, ...] = ()
    dp_free_blocks: tuple[int, ...] = ()

    @classmethod
    def of(cls, engine: Engine) -> EngineLoad:
        """A snapshot of `engine`; only on the thread that drives it (or before that thread starts)."""
        config = engine.config
        dp = engine.blocks if isinstance(engine.blocks, DpBlockManager) else None
        return cls(
            running=engine.num_running,
            waiting=engine.num_waiting,
            waiting_tokens=engine.num_waiting_tokens,
            free_blocks=engine.blocks.num_free,
            total_blocks=engine.blocks.num_blocks,
            prefill_tokens=engine.stats.prefill_tokens,
            decode_tokens=engine.stats.decode_tokens,
            requests=frozenset(engine.requests),
            block_size=config.block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model.config.vocab_size,
            group_free_blocks=tuple(b.num_free for b in engine.group_blocks),
            group_total_blocks=tuple(b.num_blocks for b in engine.group_blocks),
            prefix_cache=engine.prefix_cache_stats(),
            dp_running=tuple(dp.seqs_of()) if dp is not None else (),
            dp_free_blocks=tuple(dp.rank_free(r) for r in range(dp.world)) if dp is not None else (),
        )

    @property
    def usage(self) -> float:
        """Fraction of group 0's blocks in use, 0.0–1.0."""
        return 1.0 - self.free_blocks / self.total_blocks

    def group_usage(self) -> tuple[float, ...]:
        """Fraction of each KV cache group's blocks in use, group 0 first."""
        return tuple(
            1.0 - free / total for free, total in zip(self.group_free_blocks, self.group_total_blocks, strict=True)
        )

    def has_room(self) -> bool:
        """The engine can start one more job soon: a sequence slot and blocks to spare, and the queue shorter
        than one step's token budget — so the next step can batch several prompts, while a job another worker
        could start now is not hoarded here."""
        return (
            self.running + self.waiting < self.max_num_seqs
            and self.waiting_tokens < self.max_num_batched_tokens
            and self.fit_usage < MAX_BLOCK_USAGE
        )

    @property
    def fit_usage(self) -> float:
        """Block usage as a new request meets it: group 0's, or under data-parallel attention the least used
        rank's (a request's blocks all come from one rank, the leader picks the least loaded)."""
        if not self.dp_free_blocks:
            return self.usage
        return 1.0 - max(self.dp_free_blocks) / (self.total_blocks // len(self.dp_free_blocks))
