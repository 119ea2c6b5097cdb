"""Admission stage 1b, the cached prefix (decode-side reuse, docs/architecture.md): before a job's KV is pulled,
this worker's own prefix cache is asked how much of its prompt it holds under the job's cache salt (a multi-turn
conversation's next turn finds the previous turn's prompt and answer, decoded here). Those blocks are pinned in
the engine (Engine.pin_prefix: no allocation evicts them meanwhile), the pull asks only for the rest
(PullRequest.skip_tokens) and the import puts the pulled blocks behind them. The pin is keyed by the job's KV key;
the import consumes it, and whatever ends the admission otherwise gives it back (`unpin`).

Pinned only where a partial pull can be had: the job asks for it (DecodeJob.kv_reuse: the gateway's
decode_kv_reuse setting), its KV is held by a prefill worker (not a moved or locally prefilled job), and this
worker is one rank (a group's ranks pull whole).
"""

from __future__ import annotations

from shared.engine.async_engine import AsyncEngine
from shared.engine.kv_export import KVExport
from shared.messages import DecodeJob


def may_reuse(job: DecodeJob, single_rank: bool) -> bool:
    return job.kv_reuse and single_rank and not job.prefill_here and job.prefill_worker is not None


async def pin(engine: AsyncEngine, key: str, job: DecodeJob) -> int:
    """Pin the job's cached prompt blocks under `key`; → the tokens they hold (0: none, nothing pinned; also when
    `key` is pinned already: another admission of the same attempt owns that pin, this one pulls whole)."""

    def pin_it(e) -> int:
        try:
            return e.pin_prefix(key, job.prompt_token_ids, job.cache_salt)
        except ValueError:
            return 0

    return await engine.call(pin_it)


async def unpin(engine: AsyncEngine, key: str) -> None:
    """Give back a pin the import did not take (a no-op once it did)."""
    await engine.call(lambda e: e.unpin_prefix(key))


def fits_behind(kv: KVExport, block_size: int) -> bool:
    """Whether a pulled KV can go behind cached blocks of `block_size`: it starts on one of their boundaries (a
    source whose blocks are not a multiple or divisor of ours may cut inside one; such a KV is recomputed)."""
    return kv.first_block * kv.layout.block_size % block_size == 0


def skipped_blocks(kv: KVExport, block_size: int) -> int:
    """This engine's blocks the pull did not carry (its first carried token's block)."""
    return kv.first_block_at(block_size)
