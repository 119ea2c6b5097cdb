"""The scheduler decides what runs each step and returns it as a plan; the runner executes the plan; only
`update_from_output` changes request state after the fact.

Policy (continuous batching):
- Running requests that are decoding get one token each, first. A decode that needs a new block and finds
  none preempts the most recently admitted request (its blocks are freed, it returns to the front of the
  queue and is recomputed later): requests that do not fit wait, they never corrupt another.
- The remaining token budget goes to prefill: first to prompts already being prefilled in chunks, then to
  waiting requests in arrival order. With chunked prefill a long prompt is cut to fit the budget and
  shares steps with decodes; without it a step that admits prompts runs only whole prompts (the classic
  colocated behaviour, where a long prompt stalls every decode for one step).
- Sliding windows (a model whose every layer slides, Mistral-style; `window` = the largest layer window):
  before each plan, the blocks of a running request that lie wholly behind the window of its next query
  are freed (the table entry becomes FREED). A request that holds its KV for a hand-off exports only the
  blocks from its first unfreed one on (KVExport.first_block): the hand-off moves the window's blocks.
- KV cache groups (full and sliding layers mixed, gpt-oss; shared/engine/kv_groups.py): `blocks`/`window` are
  group 0's (the full layers: nothing freed), `window_groups` the others, each with its own block manager and
  a table per request (Request.group_tables) freed behind its window as above. A request grows in every
  group or in none; preemption and finishing free every group's table.
- Prefix caching (`prefix`, shared/engine/prefix_caching.py): a request admitted from the queue (fresh, or
  preempted) first takes the cached blocks of its longest usable prefix and is admitted with those tokens
  computed; after every step the full blocks a request computed are offered to the cache. Released blocks that
  are cached stay in the pool (evictable) until an allocation needs them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from shared.engine.block_manager import FREED, BlockManager
from shared.engine.config import SchedulerConfig
from shared.engine.prefix_caching import PrefixCaching
from shared.engine.request import FinishReason, GroupTable, Request, RequestStatus
from shared.engine.sampling import SamplingParams

PENDING = -1  # an output token sampled by a step still in flight (overlap scheduling: `advance`)


class ScheduledSeq(msgspec.Struct, frozen=True):
    """Made per sequence per step (as StepResult): a frozen msgspec struct, ~3x cheaper than a frozen dataclass."""

    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step brings the request up to date, so a next token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulePlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes (one token) first, then prefill chunks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class StepResult(msgspec.Struct, frozen=True):
    request: Request
    new_token_id: int
    finished: bool


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        window: int | None = None,
        window_groups: Sequence[tuple[BlockManager, int]] = (),
        prefix: PrefixCaching | None = None,
    ) -> None:
        """`max_model_len`: prompt + output tokens of one request (the engine resolves it from the model).
        `window`: every layer of `blocks`' group slides within this (ModelConfig.freeable_window for a one-group
        model): blocks behind it are freed; None = every block is kept while the request runs.
        `window_groups`: the other KV cache groups' block managers and windows (kv_groups.py), in group order.
        `prefix`: prefix caching (None: off); every group's block manager then has a PrefixCache."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                "without chunked prefill a whole prompt must fit in one step: "
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) < max_model_len ({max_model_len})"
            )
        self.config = config
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.window = window
        self.window_groups = list(window_groups)
        self.freed_behind_window = 0  # blocks given back behind the window so far (a counter for stats/tests)
        self.prefix = prefix

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose KV is already in its blocks (imported from another engine)."""
        request.status = RequestStatus.RUNNING
        request.scheduled_at = request.scheduled_at or time.time()
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)

    # ---- planning -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulePlan:
        if self.window is not None or self.window_groups:  # nothing slides: no table to walk per request
            for req in self.running:
                self._free_behind_window(req)
        plan = SchedulePlan()
        if not self.config.enable_chunked_prefill and self._admit_waiting(plan, self.config.max_num_batched_tokens):
            return plan  # a prefill-only step
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(plan, budget)
        budget = self._continue_prefills(plan, budget)
        # After a preemption memory is tight: admitting now would hand the victim's blocks straight back.
        if self.config.enable_chunked_prefill and not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_decodes(self, plan: SchedulePlan, budget: int) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running or not self._is_decoding(req):
                continue  # preempted meanwhile, or still prefilling
            if not self._reserve(req, req.num_computed_tokens + 1, plan):
                continue  # req itself was preempted
            plan.seqs.append(ScheduledSeq(req, 1))
            budget -= 1
        return budget

    def _continue_prefills(self, plan: SchedulePlan, budget: int) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if self._is_decoding(req) or req not in self.running or req.num_computed_tokens >= req.num_tokens:
                continue  # the last: its last token is awaited from a step in flight that ends it (overlap.py)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, req.num_computed_tokens + n, plan):
                continue
            plan.seqs.append(ScheduledSeq(req, n))
            budget -= n
        return budget

    def _admit_waiting(self, plan: SchedulePlan, budget: int) -> bool:
        """Admit queued requests in order while budget, sequence slots and blocks allow."""
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]  # nothing computed, no blocks
            hit = self.prefix.take_hit(req, self.groups(), self.tables(req)) if self.prefix is not None else 0
            req.num_computed_tokens = hit
            n = req.num_tokens - hit
            if n > budget and self.config.enable_chunked_prefill:
                n = budget
            if n > budget or not self._grow(req, hit + n):
                self.release(req)  # the hit's blocks go back (still cached)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.scheduled_at is None and self.prefix is not None:  # its first admission
                self.prefix.admitted(req, hit)
            req.scheduled_at = req.scheduled_at or time.time()
            self.running.append(req)
            plan.seqs.append(ScheduledSeq(req, n))
            budget -= n
            admitted = True
        return admitted

    def groups(self) -> list[tuple[BlockManager, int | None]]:
        """Every KV cache group's (block manager, window), group 0 first: the order of Request.group_tables."""
        return [(self.blocks, self.window), *self.window_groups]

    def tables(self, req: Request) -> list[GroupTable]:
        """`req`'s table in every group (the missing ones made empty): in the order of `groups()`."""
        while len(req.group_tables) < 1 + len(self.window_groups):
            req.group_tables.append(GroupTable())
        return req.group_tables

    def _free_behind_window(self, req: Request) -> None:
        """Free, in every windowed group, the blocks no query of `req` reads again: its next query sits at
        num_computed_tokens, and sees keys from num_computed_tokens - window + 1 on (so do all later ones)."""
        for (blocks, window), table in zip(self.groups(), self.tables(req), strict=True):
            if window is None:
                continue
            behind = max(0, req.num_computed_tokens - window + 1) // blocks.block_size
            behind = min(behind, len(table.blocks))
            for i in range(table.freed, behind):
                if table.blocks[i] != FREED:  # a forked child's table may share the parent's FREED entries
                    blocks.free([table.blocks[i]])
                    table.blocks[i] = FREED
                    self.freed_behind_window += 1
            table.freed = max(table.freed, behind)

    def release(self, req: Request) -> None:
        """Give back every group's blocks of `req` (one reference each) and empty its tables."""
        for (blocks, _), table in zip(self.groups(), self.tables(req), strict=True):
            # last block first: cached blocks become evictable in this order, so a prefix loses its tail before
            # its head (a hit needs the head)
            blocks.free(table.blocks[::-1])
            table.blocks, table.freed = [], 0
        req.blocks_offered = 0

    def _is_decoding(self, req: Request) -> bool:
        return req.num_computed_tokens == req.num_tokens - 1

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for `num_tokens` tokens if the pool can; False (nothing taken) otherwise."""
        if not self.window_groups and len(req.group_tables[0].blocks) * self.blocks.block_size >= num_tokens:
            return True  # one group whose blocks hold them already: most decode steps
        groups, tables = self.groups(), self.tables(req)
        needs = [blocks.blocks_for(num_tokens) - len(t.blocks) for (blocks, _), t in zip(groups, tables, strict=True)]
        lasts = [next((b for b in reversed(t.blocks) if b != FREED), None) for t in tables]
        if not all(
            blocks.can_allocate(n, after=last)
            for (blocks, _), n, last in zip(groups, needs, lasts, strict=True)
            if n > 0
        ):
            return False  # all groups or none
        for (blocks, _), table, n, last in zip(groups, tables, needs, lasts, strict=True):
            if n > 0:
                table.blocks.extend(blocks.allocate(n, after=last))  # one run where the pool allows
        return True

    def _reserve(self, req: Request, num_tokens: int, plan: SchedulePlan) -> bool:
        """Like _grow, but preempts the newest running requests until it fits. False if req was preempted."""
        while not self._grow(req, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed_tokens = 0  # recompute prompt + output so far when readmitted
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        plan.preempted.append(req)
        # A scheduled entry for the victim from earlier in this plan must not run.
        plan.seqs[:] = [s for s in plan.seqs if s.request is not req]

    # ---- applying results -----------------------------------------------------------------------------

    def update_from_output(self, plan: SchedulePlan, sampled: dict[str, int]) -> list[StepResult]:
        """Advance every scheduled request by its tokens, append sampled tokens, finish the done ones."""
        results = []
        for seq in plan.seqs:
            req = seq.request
            if req.is_finished:
                continue  # aborted while the step ran
            samples = seq.samples
            req.num_computed_tokens += seq.num_tokens
            if self.prefix is not None:  # before a finish releases them
                self.prefix.offer(req, self.groups(), self.tables(req))
            if not samples:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            results.append(StepResult(req, token, reason is not None))
        return results

    def finish_reason(self, req: Request, token: int) -> FinishReason | None:
        """Why `req` ends with `token` as its last output token, or None when it goes on."""
        return self._finish_reason(req, token)

    def _finish_reason(self, req: Request, token: int, num_output: int | None = None) -> FinishReason | None:
        """`num_output`: the output tokens counted with `token` as the last (default: all of them)."""
        if self.stops(req.params, token):
            return FinishReason.STOP
        if num_output is None:
            num_output = len(req.output_token_ids)
        if num_output >= req.params.max_tokens or len(req.prompt_token_ids) + num_output >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def stops(self, params: SamplingParams, token: int) -> bool:
        """Whether `token` ends a request of `params` by itself (a stop token id, or EOS unless ignored)."""
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    # ---- overlap scheduling (shared/engine/overlap.py): the state runs one step ahead of the tokens ------

    def advance(self, plan: SchedulePlan) -> tuple[list[bool], dict[str, int]]:
        """A plan launched before its tokens are known: its tokens count as computed now, so the next plan can be
        made while it runs. Every sequence that samples gets a PENDING output token (the next step's input, filled
        in by the forward thread from this step's sample), unless its token ends it by length whatever it is: that
        one gets none, so its computed tokens reach its num_tokens and no plan schedules it again. → (per
        sequence, whether it samples; request id → the index of its PENDING token), for `resolve`."""
        samples = [s.samples for s in plan.seqs]
        pending: dict[str, int] = {}
        for seq, sampling in zip(plan.seqs, samples, strict=True):
            req = seq.request
            req.num_computed_tokens += seq.num_tokens
            if not sampling:
                continue
            after = len(req.output_token_ids) + 1
            if after >= req.params.max_tokens or len(req.prompt_token_ids) + after >= self.max_model_len:
                continue  # its last token
            pending[req.request_id] = len(req.output_token_ids)
            req.output_token_ids.append(PENDING)
        return samples, pending

    def resolve(
        self, plan: SchedulePlan, samples: list[bool], pending: dict[str, int], sampled: dict[str, int]
    ) -> list[StepResult]:
        """`update_from_output` for an `advance`d plan, now that its tokens are known, while the next plan may be in
        flight: each PENDING token is replaced by the sampled one (else it is appended). A request that ends drops
        what a later plan already gave it (its next PENDING token, the next step's computed count) and finishes;
        that step's row for it is wasted, and `resolve` skips it then (finished). A request preempted meanwhile
        (waiting, nothing computed) takes its token too, and may end in the queue."""
        results = []
        for seq, sampling in zip(plan.seqs, samples, strict=True):
            req = seq.request
            if req.is_finished:
                continue  # aborted, or ended by the step before (this row was wasted)
            reason, token = None, 0
            if sampling:
                token = sampled[req.request_id]
                at = pending.get(req.request_id)
                if at is None:
                    req.output_token_ids.append(token)
                    at = len(req.output_token_ids) - 1
                else:
                    req.output_token_ids[at] = token
                reason = self._finish_reason(req, token, at + 1)
                if reason is not None:
                    del req.output_token_ids[at + 1 :]
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if self.prefix is not None:  # before a finish releases them; every token they cover is known now
                self.prefix.offer(req, self.groups(), self.tables(req))
            if not sampling:
                continue
            if reason is not None:
                if req.status is RequestStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, reason)
            results.append(StepResult(req, token, reason is not None))
        return results

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        keep = req.hold_kv and reason is not FinishReason.ABORT
        if not keep:
            self.release(req)
        elif req.num_computed_tokens:  # held for a hand-off: what is behind its next query's window never moves
            self._free_behind_window(req)
