"""One process's inference engine: the step loop (plan → execute → update) over parts it is handed.

Single-threaded by design: callers (the services) drive `step()` from one loop and call `add_request`,
`abort`, `export_kv`, `import_kv` between steps. (With overlap scheduling, overlap.py, a step's forward and
sampling run on a forward thread while the caller's thread plans the next; the caller still sees one thread.)
`Engine.build(config)` (or `from_dir`) builds the parts
(build.py: device and kernel setup, KV planning, graph capture) and hands them in; the engine keeps the
requests' lifecycle and the step loop, and delegates: a step's execution to its runner (runner.py), KV export,
import, release and layer streams to `KvHandoff` (kv_handoff.py), n choices to `Forker` (forker.py).

On a worker group (config.tp / config.ep > 1, `group` this rank's RankGroup) the engine holds this rank's
shard of the model and a KV pool of its KV heads only; the pool's block count is agreed (the minimum over the
ranks). Every rank's model call is a collective, so the ranks must run the same steps: in SPMD use (tests)
every rank runs the same requests and the deterministic scheduler makes the same plans; the logits are full on
every rank, so greedy sampling agrees. The engine knows nothing of the group runtime that may wrap it
(shared/parallel/group_engine.py).

KV cache groups (shared/engine/kv_groups.py: gpt-oss's full and sliding layers): one pool, block manager and
block table per request per group; `pool`, `blocks` are group 0's (the only ones of a one-group model), `pools`
and `group_blocks` all of them. Single-rank engines only: on a worker group a hybrid model keeps one pool.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.block_manager import FREED
from shared.engine.build import EngineParts, build_parts
from shared.engine.config import EngineConfig
from shared.engine.decode_graphs import GraphBackend
from shared.engine.fork import Choice, PendingForks
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVPool
from shared.engine.layer_streams import OnStart
from shared.engine.outputs import RequestOutput, request_output
from shared.engine.overlap import ForwardThread, InFlight, needs_lockstep
from shared.engine.prefix_cache import PrefixCacheEvents
from shared.engine.prefix_caching import PrefixCacheStats
from shared.engine.request import Request
from shared.engine.runner import RunnerOutput
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import SchedulePlan, StepResult
from shared.engine.step_clock import StepClock
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup

__all__ = ["Engine", "EngineStats", "PrefixCacheEvents", "PrefixCacheStats", "RequestOutput"]


@dataclass
class EngineStats:
    """Cumulative token counts, by the phase the model computed them in."""

    prefill_tokens: int = 0  # tokens computed as part of a prompt (or a recomputation)
    decode_tokens: int = 0  # single tokens fed back while decoding
    preemptions: int = 0
    steps: int = 0
    step_s: float = 0.0  # wall seconds inside steps that ran a batch (schedule, forward, sampling, update)
    overlapped_steps: int = 0  # of `steps`: launched before the step ahead of them resolved (overlap scheduling)


class Engine:
    def __init__(self, parts: EngineParts) -> None:
        """The engine over `parts` (build.py); `Engine.build` makes them from a configuration."""
        # the step loop's state and the collaborators that share it
        self.requests = parts.requests
        self.scheduler = parts.scheduler
        self.structured = parts.structured
        self.layer_streams = parts.layer_streams
        self.runner = parts.runner
        self.handoff = parts.handoff
        self.forker = parts.forker
        self.limits = parts.limits
        self.kv = parts.kv
        self.stats = EngineStats()
        self.last_logits: Mapping[str, torch.Tensor] = {}  # from the latest step, for tests and logprobs
        self.step_clock: StepClock | None = None  # stamps the steps' phases (time_steps); None: no stamps
        # what set-up decided, and views of the KV cache under the names callers read (nothing here changes)
        self.config, self.parallel, self.group = parts.config, parts.config.parallel, parts.group
        self.device, self.model, self.kernels = parts.device, parts.model, parts.kernels
        self.max_model_len, self.graph_capture = parts.max_model_len, parts.graph_capture
        self.layout, self.kv_groups = self.kv.layout, self.kv.groups
        self.kv_plans, self.kv_plan = self.kv.plans, self.kv.plans[0]
        self.pools = self.kv.pools  # the one list the runner, hand-off and forks share (a group's leader mirrors [0])
        self.group_blocks, self.blocks = self.kv.blocks, self.kv.blocks[0]
        # overlap scheduling (overlap.py): the thread the forward runs on, the step launched and not yet resolved,
        # and the outputs of one resolved outside `step` (an engine call drained it), for the next `step`
        overlap = self.config.overlap_scheduling and self.group.world == 1
        self._forward = ForwardThread(self.runner, self.scheduler.stops) if overlap else None
        self._in_flight: InFlight | None = None
        self._ready: list[RequestOutput] = []

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model: CausalLM | None = None,
        graph_backend: GraphBackend | None = None,
        group: RankGroup | None = None,
    ) -> Engine:
        """The engine `config` describes. model: instead of loading it (this rank's shard) from config.model.
        graph_backend: how decode steps are captured, instead of what the settings choose (CUDA graphs on
        CUDA with the Triton kernels): tests and the gpu-check's CPU rehearsal pass decode_graphs.EagerReplay.
        It needs kernels=triton, and cuda_graphs off still turns it off. group: this rank's worker group when
        config.tp or config.ep > 1 (every rank builds its engine; shared/parallel/group_engine.py starts them)."""
        return cls(build_parts(config, model, graph_backend, group))

    @classmethod
    def from_dir(cls, model_dir: str | Path, graph_backend: GraphBackend | None = None, **overrides) -> Engine:
        return cls.build(EngineConfig(model=str(model_dir), **overrides), graph_backend=graph_backend)

    @property
    def pool(self) -> KVPool:
        """Group 0's pool (the only one of a one-group model): derived, so replacing `pools[0]` (a worker
        group's mirrored pool) cannot leave a second reference behind."""
        return self.pools[0]

    @property
    def pending_forks(self) -> PendingForks:
        """Children waiting for their parents' first tokens (add_group)."""
        return self.forker.pending

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        output_token_ids: list[int] | None = None,
        cache_salt: str = "",
    ) -> None:
        """Queue a request. Raises ValueError for an empty, too long or out-of-vocabulary prompt, or a
        duplicate id. With hold_kv the blocks outlive the request until `release_kv`. `output_token_ids`
        continues a request started elsewhere: prompt and those tokens are recomputed (less any cached prefix),
        then it samples on. `cache_salt`: its prefix-cache salt (shared/prefix_hash.py request_salt): it reuses
        and leaves cached blocks only among requests of the same salt."""
        self.limits.check(self.requests, request_id, prompt_token_ids + (output_token_ids or []))
        req = Request(request_id, list(prompt_token_ids), params, hold_kv=hold_kv, cache_salt=cache_salt)
        req.output_token_ids = list(output_token_ids or [])
        self.structured.add(request_id, params.structured, req.output_token_ids)  # replays the output so far
        self.requests[request_id] = req
        self.scheduler.add(req)

    def add_group(
        self, prompt_token_ids: list[int], choices: list[Choice], hold_kv: bool = False, cache_salt: str = ""
    ) -> None:
        """Queue n choices of one prompt (shared/engine/fork.py). Fresh choices (no tokens yet): the first
        computes the prompt once, and at its first token the others are forked from its KV, each sampling its
        first token from the same logits with its own parameters. Choices that carry tokens (a migrated group:
        each has its own tokens after the prompt) are queued as separate requests. Raises ValueError as
        add_request does, or for a group that mixes fresh and continued choices; nothing is queued then.
        `cache_salt`: every choice's (add_request)."""
        fresh = [not c.output_token_ids for c in choices]
        if any(fresh) and not all(fresh):
            raise ValueError("a group's choices are either all fresh or all continued")
        ids = [c.request_id for c in choices]
        if not choices or len(set(ids)) != len(ids):
            raise ValueError("a group needs at least one choice, with distinct ids")
        for c in choices:
            self.limits.check(self.requests, c.request_id, prompt_token_ids + list(c.output_token_ids))
        if not all(fresh) or len(choices) == 1:
            for c in choices:
                self.add_request(
                    c.request_id, prompt_token_ids, c.params, hold_kv, list(c.output_token_ids), cache_salt
                )
            return
        parent, *children = choices
        # the parent holds its blocks past its own end until the children are forked from them
        self.add_request(parent.request_id, prompt_token_ids, parent.params, hold_kv=True, cache_salt=cache_salt)
        self.forker.pending.add(parent.request_id, children, hold_kv)

    def fork(self, parent_id: str, children: list[Choice]) -> list[RequestOutput]:
        """Fork choices that already have tokens from a request whose KV covers its prompt (Forker.fork)."""
        self._drain()
        return self.forker.fork(parent_id, children)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (held ones too). False if the id is unknown. A group's choice can be
        aborted at any stage: a child not forked yet is dropped, a parent before its first token hands the prompt
        to the next choice (shared/engine/fork.py)."""
        req = self.requests.pop(request_id, None)
        self.structured.remove(request_id)
        self.runner.request_experts.forget(request_id)
        self.layer_streams.drop(request_id)  # a stream of its KV fails (its sender frees nothing twice)
        if req is None:
            return self.forker.pending.drop_child(request_id)  # a child not forked yet holds nothing
        if req.is_finished:  # held for export
            self.scheduler.release(req)
        else:
            self.scheduler.abort(req)
        pending = self.forker.pending.pop(request_id)
        if pending is not None and pending.children:  # a parent before its first token: the next choice takes over
            heir, *rest = pending.children
            self.add_group(req.prompt_token_ids, [heir, *rest], pending.parent_holds_kv, req.cache_salt)
        return True

    def has_unfinished(self) -> bool:
        """Requests to run, or a launched step (overlap scheduling) whose outputs `step` has not returned yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._ready)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the queued requests still need computed. Safe to read from another thread: the queue is
        copied in one C call under the GIL, and each request's counts are plain ints."""
        return sum(r.num_tokens - r.num_computed_tokens for r in tuple(self.scheduler.waiting))

    def time_steps(self, clock: StepClock | None) -> None:
        """Stamp every following step's phases on `clock` (step_clock.py); None stops it."""
        self.step_clock = self.runner.step_clock = clock

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the new token of every request that produced one. With overlap
        scheduling (overlap.py) this launches the next batch and returns the tokens of the one launched before."""
        if self._forward is None:
            return self._step_lockstep()
        if self._needs_lockstep():
            self._drain()
            return self._take_ready() + self._step_lockstep()
        return self._step_overlapped()

    def _step_lockstep(self) -> list[RequestOutput]:
        started = time.perf_counter()
        clock = self.step_clock
        plan = self._plan(clock)
        if not plan.seqs:
            return []
        self.model.on_layer = self.layer_streams.begin(plan)  # None unless a watched prompt completes now
        try:
            out = self.runner.execute(plan)
        except BaseException as e:
            self.layer_streams.fail_all(f"the prefill step failed: {e!r}")
            raise
        finally:
            self.model.on_layer = None
        self.last_logits = out.logits
        self._counted(self._count_tokens(plan))
        outputs = self._emit(self.scheduler.update_from_output(plan, out.sampled), out)
        if clock is not None:
            clock.mark("update")
        self.stats.step_s += time.perf_counter() - started
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Plan and launch the next batch, then resolve the one in flight (overlap.py). The clock's phases here:
        schedule, inputs (the inputs built and the batch launched), model (the wait for the batch in flight),
        update."""
        assert self._forward is not None
        started = time.perf_counter()
        clock = self.step_clock
        plan = self._plan(clock)
        launched = None
        if plan.seqs:
            step = self.runner.prepare(plan)
            tokens = self._count_tokens(plan)
            samples, pending = self.scheduler.advance(plan)
            launched = InFlight(plan, tokens, samples, pending, self._forward.launch(step))
        if clock is not None:
            clock.mark("inputs")
        previous, self._in_flight = self._in_flight, launched
        outputs = self._take_ready()
        if previous is not None:
            out = previous.output.result()
            if clock is not None:
                clock.mark("model")
            outputs += self._resolve(previous, out)
        if clock is not None:
            clock.mark("update")
        if launched is not None or previous is not None:
            self.stats.step_s += time.perf_counter() - started
        return outputs

    def _plan(self, clock: StepClock | None) -> SchedulePlan:
        if clock is not None:
            clock.begin()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if clock is not None:
            clock.mark("schedule")
            decode_only = all(s.num_tokens == 1 and s.request.output_token_ids for s in plan.seqs)
            clock.note(len(plan.seqs), plan.num_tokens, decode_only)
        return plan

    def _count_tokens(self, plan: SchedulePlan) -> tuple[int, int]:
        """(prefill, decode) tokens of a plan not run yet (nor `advance`d)."""
        prefill = decode = 0
        for s in plan.seqs:
            req = s.request  # a decode feeds back the last sampled token; a 1-token prompt is a prefill
            if s.num_tokens == 1 and req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1:
                decode += 1
            else:
                prefill += s.num_tokens
        return prefill, decode

    def _counted(self, tokens: tuple[int, int]) -> None:
        self.stats.steps += 1
        self.stats.prefill_tokens += tokens[0]
        self.stats.decode_tokens += tokens[1]

    def _emit(self, results: list[StepResult], out: RunnerOutput) -> list[RequestOutput]:
        """The outputs of a step's results: grammars advanced, finished requests forgotten, forks made."""
        outputs = []
        for r in results:
            req = r.request
            self.structured.accept(req.request_id, r.new_token_id)
            if r.finished:
                self.structured.remove(req.request_id)
            if r.finished and not req.hold_kv:
                self.requests.pop(req.request_id, None)
            logprobs = out.logprobs.get(req.request_id)
            outputs.append(request_output(req, [r.new_token_id], None if logprobs is None else [logprobs]))
            if req.request_id in self.forker.pending:  # a group's parent sampled its first token
                outputs += self.forker.at_first_token(req, out.logits[req.request_id])
        self.layer_streams.end(out.sampled)  # last: a stream's sender may free the request once it ends
        return outputs

    # ---- overlap scheduling (overlap.py) -----------------------------------------------------------------

    def _needs_lockstep(self) -> bool:
        """Whether the next step runs in lockstep: a request that may be in it needs its previous token first, or
        something of the engine watches the forward (overlap.py). The requests that may be in it: the running
        ones and as many of the queue's first as there are free sequence slots (admission goes in order)."""
        if self.forker.pending or self.layer_streams.active or self.runner.request_experts.active:
            return True
        scheduler = self.scheduler
        if any(needs_lockstep(r.params) for r in scheduler.running):
            return True
        slots = scheduler.config.max_num_seqs - len(scheduler.running)
        return any(needs_lockstep(r.params) for r in itertools.islice(scheduler.waiting, max(0, slots)))

    def _resolve(self, launched: InFlight, out: RunnerOutput) -> list[RequestOutput]:
        # counted now, not at launch: a step() call's step_s then holds the wait for the step it counts
        self._counted(launched.tokens)
        self.stats.overlapped_steps += 1
        self.last_logits = out.logits
        results = self.scheduler.resolve(launched.plan, launched.samples, launched.pending, out.sampled)
        return self._emit(results, out)

    def _drain(self) -> None:
        """Wait for the step in flight and update with its tokens; its outputs go out with the next `step`. Every
        call that reads or writes KV blocks on this thread, or needs the requests' tokens all known, drains first."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._ready += self._resolve(launched, launched.output.result())

    def _take_ready(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        return ready

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; output token ids in prompt order (a convenience for tools and tests)."""
        ids = [f"generate-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                results[o.request_id] += o.new_token_ids
        return [results[rid] for rid in ids]

    # ---- KV hand-off (kv_handoff.py) ------------------------------------------------------------------

    def export_kv(
        self, request_id: str, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    ) -> KVExport:
        """Copy out a decoding or held request's KV; no state changes (KvHandoff.export)."""
        self._drain()
        return self.handoff.export(request_id, alloc)

    def kv_blocks(self, request_id: str) -> tuple[int, list[int], int]:
        """(tokens computed, pool blocks in order, the request's block they start at): KvHandoff.blocks."""
        self._drain()
        return self.handoff.blocks(request_id)

    def group_kv_blocks(self, request_id: str) -> tuple[int, list[tuple[int, list[int]]]]:
        """(tokens computed, per KV cache group (first held block, pool blocks)): KvHandoff.group_blocks."""
        self._drain()
        return self.handoff.group_blocks(request_id)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a finished request that held them; False if there is none (KvHandoff.release)."""
        self._drain()
        self.runner.request_experts.forget(request_id)
        return self.handoff.release(request_id)

    def trace_experts(self, request_id: str) -> None:
        """Count which experts `request_id`'s prompt is routed to (call before its first step; `take_request_experts`
        reads them). Nothing on a model without routed experts."""
        self.runner.request_experts.want(request_id)

    def take_request_experts(self, request_id: str) -> dict[int, list[int]]:
        """Sparse layer → the tokens of the request's computed prompt routed to each logical expert (empty when not
        traced); forgets them."""
        return self.runner.request_experts.take(request_id)

    def import_kv(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: KVExport,
        cache_salt: str = "",
        pinned: str | None = None,
    ) -> None:
        """Continue a request from KV computed elsewhere (KvHandoff.import_): NoFreeBlocksError, nothing taken,
        when the pool is full. `cache_salt`: as add_request's (its imported full blocks are offered to the prefix
        cache under it). `pinned`: the key of a `pin_prefix` whose blocks go in front of a partial pull's KV
        (consumed either way)."""
        self._drain()
        self.handoff.import_(request_id, prompt_token_ids, output_token_ids, params, kv, cache_salt, pinned)

    def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str = "") -> int:
        """Pin this engine's cached first blocks of a prompt under `key` until an import takes them (import_kv
        `pinned=key`) or `unpin_prefix`: → the tokens they hold (0: none pinned; prefix caching off, several KV
        cache groups, windows, a worker group). PrefixPins.pin."""
        self._drain()
        return self.handoff.pins.pin(key, prompt_token_ids, cache_salt)

    def unpin_prefix(self, key: str) -> bool:
        """Give back the blocks pinned under `key` (a pull that failed or was not imported); False if none."""
        self._drain()
        return self.handoff.pins.unpin(key)

    def can_stream_kv(self) -> bool:
        """Whether this engine can stream a request's KV layer by layer (KvHandoff.can_stream)."""
        return self.handoff.can_stream()

    def stream_kv(self, request_id: str, on_start: OnStart) -> None:
        """Watch a fresh prefill holding its KV; `on_start` when its last chunk starts (KvHandoff.stream)."""
        self._drain()
        self.handoff.stream(request_id, on_start)

    # ---- prefix cache (prefix_caching.py) ---------------------------------------------------------------

    def prefix_cache_events(self) -> PrefixCacheEvents:
        """The hashes of KV cache group 0's blocks that became cached and that were evicted since the last call
        (netted out; `overflowed`: too many to keep, take `prefix_cache_hashes` instead). Empty when off."""
        prefix = self.scheduler.prefix
        return PrefixCacheEvents() if prefix is None else prefix.events()

    def prefix_cache_hashes(self) -> list[int]:
        """Every hash group 0 holds now (cached blocks, referenced or evictable): the snapshot. Empty when off."""
        prefix = self.scheduler.prefix
        return [] if prefix is None else prefix.routed.hashes()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up and found cached, cached blocks, evictions (zeros when off)."""
        prefix = self.scheduler.prefix
        return PrefixCacheStats() if prefix is None else prefix.stats()

    # ---- integrity -------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every block's reference count is the number of live requests whose
        tables hold it (forked choices share prompt blocks), so no block is free while held, nor held by
        nobody; cached blocks nobody holds are evictable (BlockManager.check_integrity). In every KV cache group."""
        for g, blocks in enumerate(self.group_blocks):
            blocks.check_integrity()
            holders = [0] * blocks.num_blocks
            for req in self.requests.values():
                for b in self.scheduler.tables(req)[g].blocks:
                    if b == FREED:  # given back behind the sliding window
                        continue
                    if blocks.ref_count(b) == 0:
                        raise AssertionError(f"request {req.request_id} holds free block {b} of group {g}")
                    holders[b] += 1
            if g == 0:  # blocks pinned for imports on their way (prefix_pins.py) are held by their pins
                for b in self.handoff.pins.pinned():
                    holders[b] += 1
            for b, n in enumerate(holders):
                if blocks.ref_count(b) != n:
                    raise AssertionError(f"block {b} of group {g} has {blocks.ref_count(b)} references, {n} holders")
