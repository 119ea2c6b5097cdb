"""n sequences from one prompt: the prompt is computed once and its KV shared by copy-on-write blocks.

A group is n choices of one prompt. The first choice is the *parent*: it alone computes the prompt. The other
choices are *children*, forked from the parent once its KV covers the prompt:

- the parent's full prompt blocks are shared (one more reference each in the block manager);
- the partially filled last prompt block, if any, is copied into a block of the child's own, so that each
  sequence writes its own tokens from the prompt's end on (copied at the fork, not on first write: the first
  write is the child's very next token anyway).

Ownership invariant: a block is freed when its last reference goes. Every sequence of a group drops exactly
its own references (finish, abort, preemption all go through `BlockManager.free` of the sequence's table), so
the shared blocks return to the free list when the last sequence holding them lets go, whoever that is. A
shared block is never written: every write lands at a position >= the writer's `num_computed_tokens` >= the
prompt length, i.e. in a block past the shared ones. `Engine.check_integrity` checks the counts: every
block's reference count equals the number of live tables holding it (plus pins).

Seeds: choice i of a seeded request samples with `choice_seed(seed, i) = seed + i` (shared/choices.py), so
choice i equals a single request with that seed; unseeded choices draw independently from the engine's stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.choices import choice_seed
from shared.engine.block_manager import BlockManager, NoFreeBlocksError
from shared.engine.kv_pool import KVPool
from shared.engine.request import GroupTable, Request, RequestStatus
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import Scheduler


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: the request's, with the derived seed."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=choice_seed(params.seed, index))


@dataclass(frozen=True)
class Choice:
    """One sequence of a group: its engine request id, its parameters (seed already derived) and the tokens it
    has sampled so far (empty for a fresh choice; a migrated one carries its tokens, sampled elsewhere)."""

    request_id: str
    params: SamplingParams
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PendingFork:
    """Children waiting for their parent's first token; the parent keeps its blocks until they are forked."""

    children: tuple[Choice, ...]
    parent_holds_kv: bool  # the parent's own hold_kv (the engine holds its blocks until the fork either way)


class PendingForks:
    """The one record of children waiting for their parents' first tokens, by parent request id."""

    def __init__(self) -> None:
        self._by_parent: dict[str, PendingFork] = {}

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self._by_parent

    def __len__(self) -> int:
        return len(self._by_parent)

    def add(self, parent_id: str, children: list[Choice], parent_holds_kv: bool) -> None:
        self._by_parent[parent_id] = PendingFork(tuple(children), parent_holds_kv)

    def pop(self, parent_id: str) -> PendingFork | None:
        return self._by_parent.pop(parent_id, None)

    def drop_child(self, request_id: str) -> bool:
        """Forget a child before its fork (it was aborted: it holds nothing yet). False if no parent waits for it."""
        for parent_id, pending in self._by_parent.items():
            kept = tuple(c for c in pending.children if c.request_id != request_id)
            if len(kept) < len(pending.children):
                self._by_parent[parent_id] = PendingFork(kept, pending.parent_holds_kv)
                return True
        return False


def share_prefix(blocks: BlockManager, pool: KVPool, parent_table: list[int], num_tokens: int) -> list[int]:
    """A child's block table over the parent's first `num_tokens` tokens: full blocks shared (one more reference
    each), the partial last one copied into a fresh block. Raises NoFreeBlocksError (nothing taken) when no
    block is free for the copy."""
    full, partial = divmod(num_tokens, blocks.block_size)
    # first: all or nothing; next to the parent's last block (on the parent's DP rank under --dp-attention)
    own = blocks.allocate(1, after=parent_table[full]) if partial else []
    shared = parent_table[:full]
    blocks.incref(shared)
    if own:
        pool.copy_block(parent_table[full], own[0])
    return shared + own


def share_groups(scheduler: Scheduler, pools: list[KVPool], parent: Request, num_tokens: int) -> list[GroupTable]:
    """`share_prefix` in every KV cache group (shared/engine/kv_groups.py; `pools` in group order): the child's
    tables. All or nothing: raises NoFreeBlocksError with nothing taken in any group."""
    made: list[GroupTable] = []
    groups = scheduler.groups()
    try:
        for (blocks, _), pool, table in zip(groups, pools, scheduler.tables(parent), strict=True):
            # FREED entries (behind a window) stay FREED: the child's next query sees no more than the parent's
            made.append(GroupTable(share_prefix(blocks, pool, table.blocks, num_tokens), table.freed))
    except NoFreeBlocksError:
        for (blocks, _), table in zip(groups, made, strict=False):
            blocks.free(table.blocks)
        raise
    return made


def fork_children(
    scheduler: Scheduler, pools: list[KVPool], parent: Request, children: list[Choice], hold_kv: bool
) -> list[Request]:
    """The children as requests sharing the parent's prompt KV: each runs from the prompt's end (computing its
    own tokens so far, all but the last sampled one). A child that finds no block for its copy of the partial
    block, or no sequence slot, waits in the queue instead and recomputes the prompt when admitted (correct,
    only not shared). A child whose tokens already end it (stop token, max_tokens) finishes at once, blocks
    untouched. The caller registers the returned requests."""
    prompt_len = len(parent.prompt_token_ids)
    if parent.num_computed_tokens < prompt_len or not parent.block_table:
        raise ValueError(f"request {parent.request_id!r} has not computed its prompt; nothing to fork from")
    made = []
    for c in children:
        if not c.output_token_ids:
            raise ValueError(f"choice {c.request_id!r} has no sampled token to continue from")
        req = Request(c.request_id, parent.prompt_token_ids, c.params, hold_kv=hold_kv, cache_salt=parent.cache_salt)
        req.output_token_ids = list(c.output_token_ids)
        req.num_cached_tokens = parent.num_cached_tokens  # the prompt it shares was found cached as far
        made.append(req)
        reason = scheduler.finish_reason(req, c.output_token_ids[-1])
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
            continue
        if len(scheduler.running) >= scheduler.config.max_num_seqs:
            scheduler.add(req)
            continue
        try:
            req.group_tables = share_groups(scheduler, pools, parent, prompt_len)
        except NoFreeBlocksError:
            scheduler.add(req)
            continue
        req.num_computed_tokens = prompt_len
        scheduler.add_running(req)
    return made
