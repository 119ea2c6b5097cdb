"""Admission stage 4, into the engine, with the fork for n choices: a job's choices enter the engine as one
group, their prompt's KV computed or imported once.

- pulled: the KV is imported as the first choice and the others are forked from it, in one engine call (no
  step runs between the two, so no choice can run ahead of the import);
- recomputed: the prompt is added as a group, the engine forks the choices at its first token
  (Engine.add_group / _fork_at_first_token) as for a fresh request.
"""

from __future__ import annotations

import dataclasses

from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, RequestOutput
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport


def import_and_fork(
    engine: Engine,
    prompt: list[int],
    kv: KVExport,
    choices: list[Choice],
    cache_salt: str = "",
    pinned: str | None = None,
) -> list[RequestOutput]:
    """On the engine thread: import the pulled prompt KV as `choices[0]` (without prompt logprobs: the prefill
    worker reported them), then fork `choices[1:]` from it. Raises NoFreeBlocksError (nothing taken) or
    BorrowRevoked as import_kv does; returns the outputs of forked choices that had ended already. `cache_salt`:
    the job's (its blocks join this engine's prefix cache under it). `pinned`: the key of the prompt's cached blocks
    pinned for a partial pull (Engine.pin_prefix): the pulled rest goes behind them."""
    head = choices[0]
    params = dataclasses.replace(head.params, prompt_logprobs=None)
    engine.import_kv(
        head.request_id, prompt, list(head.output_token_ids), params, kv, cache_salt=cache_salt, pinned=pinned
    )
    return engine.fork(head.request_id, choices[1:]) if len(choices) > 1 else []


async def import_choices(
    engine: AsyncEngine,
    prompt: list[int],
    kv: KVExport,
    choices: list[Choice],
    cache_salt: str = "",
    pinned: str | None = None,
) -> list[RequestOutput]:
    """import_and_fork, called on the engine thread."""
    return await engine.call(lambda e: import_and_fork(e, prompt, kv, choices, cache_salt, pinned))


async def recompute_choices(
    engine: AsyncEngine, prompt: list[int], choices: list[Choice], cache_salt: str = ""
) -> None:
    """No KV here: the prompt (and each choice's tokens so far) computed in this engine (less what its prefix
    cache holds under `cache_salt`), choices forked there."""
    await engine.call(lambda e: e.add_group(prompt, choices, cache_salt=cache_salt))
