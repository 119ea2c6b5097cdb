"""One process's inference engine: model + KV pool + block manager + scheduler + runner.

Single-threaded by design: callers (the services) drive `step()` from one loop and call `add_request`,
`abort`, `export_kv`, `import_kv` between steps.

On a worker group (config.tp / config.ep > 1, `group` this rank's RankGroup) the engine holds this rank's
shard of the model and a KV pool of its KV heads only; the pool's block count is agreed (the minimum over the
ranks). Every rank's model call is a collective, so the ranks must run the same steps: in SPMD use (tests)
every rank runs the same requests and the deterministic scheduler makes the same plans; the logits are full on
every rank, so greedy sampling agrees.

KV cache groups (shared/engine/kv_groups.py: gpt-oss's full and sliding layers): one pool, block manager and
block table per request per group; `pool`, `blocks` are group 0's (the only ones of a one-group model), `pools`
and `group_blocks` all of them. Single-rank engines only: on a worker group a hybrid model keeps one pool.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.engine.block_manager import FREED, BlockManager, NoFreeBlocksError
from shared.engine.config import EngineConfig
from shared.engine.decode_graphs import CaptureReport, DecodeGraphs, GraphBackend, bucket_sizes, choose_backend
from shared.engine.device_setup import exclusive_setup
from shared.engine.fork import Choice, PendingForks, fork_children
from shared.engine.group_model import load_rank_model
from shared.engine.kv_budget import GroupNeed, KvPlan, grouped_summary, split_plan
from shared.engine.kv_export import KVExport, KVPart
from shared.engine.kv_groups import KVGroup, kv_groups, window_live_blocks
from shared.engine.kv_measure import outside_torch, plan_kv_pool
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.layer_streams import LayerStreams, OnStart
from shared.engine.logprobs import TokenLogprobs
from shared.engine.request import FinishReason, GroupTable, Request, RequestStatus
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler, SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.structured import StructuredDecoding
from shared.model.attention import use_cpu_attention_kernel, use_cpu_norm_rope_kernel
from shared.model.device import resolve_device
from shared.model.kernels.choice import KernelChoice, resolve_kernels
from shared.model.linear import can_prepack, prepack
from shared.model.moe import use_cpu_expert_kernel
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup
from shared.sharding.layout import kv_head_range
from shared.structured.grammar import Grammars

if TYPE_CHECKING:
    from shared.parallel.group_engine import WorkerGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    scheduled_at: float | None = None  # wall clock of the request's first scheduling (end of its queue wait)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # positions 1.. of the prompt, on the request's first output


@dataclass
class EngineStats:
    """Cumulative token counts, by the phase the model computed them in."""

    prefill_tokens: int = 0  # tokens computed as part of a prompt (or a recomputation)
    decode_tokens: int = 0  # single tokens fed back while decoding
    preemptions: int = 0
    steps: int = 0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        graph_backend: GraphBackend | None = None,
        group: RankGroup | None = None,
    ) -> None:
        """graph_backend: how decode steps are captured, instead of what the settings choose (CUDA graphs on
        CUDA with the Triton kernels): tests and the gpu-check's CPU rehearsal pass decode_graphs.EagerReplay.
        It needs kernels=triton, and cuda_graphs off still turns it off. group: this rank's worker group when
        config.tp or config.ep > 1 (every rank builds its engine; shared/parallel/group_engine.py starts them)."""
        self.config = config
        self.parallel = config.parallel
        self.group = group or RankGroup.single()
        if self.group.world != self.parallel.world:
            raise ValueError(
                f"{self.parallel} needs a group of {self.parallel.world} ranks, got {self.group.world}: "
                "a parallel engine is started by shared.parallel.group_engine.start_group"
            )
        self.device = resolve_device(config.device)  # refuses an unknown device or CUDA without one, first
        if config.threads:
            torch.set_num_threads(config.threads)
        # On CUDA, from the first look at the device until the pool exists, engines sharing the GPU wait for
        # each other: this engine's non-torch memory is counted from that look (shared/engine/device_setup.py).
        with exclusive_setup(self.device):
            non_torch_at_start = outside_torch(torch.cuda, self.device) if self.device.type == "cuda" else 0
            self.model = model or load_rank_model(config, self.group)
            backend, why_not = self._plan_kv(non_torch_at_start, graph_backend)
        self.group_blocks = [BlockManager(p.num_blocks, config.block_size) for p in self.kv_plans]
        self.blocks = self.group_blocks[0]
        self.scheduler = Scheduler(
            config.scheduler,
            self.blocks,
            self.max_model_len,
            eos_token_ids=self.model.config.eos_token_ids,
            window=self.kv_groups[0].window,
            window_groups=[
                (b, g.window)
                for b, g in zip(self.group_blocks[1:], self.kv_groups[1:], strict=True)
                if g.window is not None  # every group after the first has one (kv_groups.py)
            ],
        )
        self.graph_capture: CaptureReport | None = None  # what capturing the decode graphs took, when on
        # grammar matchers of the requests with structured output (the tokenizer is read on first use)
        mc = self.model.config
        self.structured = StructuredDecoding(
            lambda: Grammars.from_model_dir(config.model, mc.vocab_size, mc.eos_token_ids)
        )
        graphs = self._capture(backend, why_not)
        caches = None if len(self.pools) == 1 else self._group_caches()
        windows = tuple(g.window for g in self.kv_groups[1:] if g.window is not None)
        self.runner = ModelRunner(self.model, self.pool, Sampler(config.seed), graphs, self.structured, caches, windows)
        self.requests: dict[str, Request] = {}  # live, or finished and holding KV
        self.stats = EngineStats()
        self.last_logits: dict[str, torch.Tensor] = {}  # from the latest step, for tests and logprobs
        self.pending_forks = PendingForks()  # children forked at their parent's first token
        self.worker_group: WorkerGroup | None = None  # on a group's leader: its ranks (parallel/group_engine.py)
        # requests whose KV is sent layer by layer as their last chunk runs (layer_streams.py)
        self.layer_streams = LayerStreams(mc.num_layers, config.block_size)

    def _plan_kv(self, non_torch_at_start: int, graph_backend: GraphBackend | None) -> tuple[GraphBackend | None, str]:
        """Prepack the weights, choose the kernels, plan the KV pool and allocate it (sets kernels, layout,
        max_model_len, kv_plan, pool). → the decode-graph backend (None: off) and why it is off."""
        config = self.config
        mc = self.model.config
        weight = next(self.model.parameters())
        if weight.device != self.device:
            raise ValueError(f"the model is on {weight.device}, the engine is configured for {self.device}")
        dtype = weight.dtype
        if config.prepack_weights and can_prepack(self.device, dtype):
            prepack(self.model)
        self.kernels = resolve_kernels(config.kernels, self.device, config.block_size)
        self.model.use_kernels(self.kernels)  # before the KV plan: its dummy step runs the chosen kernels
        log.info("kernels: %s (setting %s, device %s)", self.kernels, config.kernels, self.device)
        if config.cpu_expert_kernel and self.device.type == "cpu" and self.kernels is KernelChoice.TORCH:
            log.info("CPU experts: %s", use_cpu_expert_kernel(self.model))
        if config.cpu_attention_kernel and self.device.type == "cpu" and self.kernels is KernelChoice.TORCH:
            log.info("CPU decode attention: %s", use_cpu_attention_kernel(self.model))
        else:
            self.model.cpu_attention = False
        if config.cpu_norm_kernel and self.device.type == "cpu":
            log.info("CPU norms and RoPE: %s", use_cpu_norm_rope_kernel(self.model))
        if self.model.layout != self.parallel:
            raise ValueError(
                f"the model was built for {self.model.layout}, the engine is configured for {self.parallel}"
            )
        kv_heads = kv_head_range(mc.num_kv_heads, self.parallel.tp, self.group.rank if self.parallel.tp > 1 else 0)
        self.layout = KVLayout.for_model(
            mc, config.block_size, str(dtype).removeprefix("torch."), tuple(kv_heads) if self.parallel.tp > 1 else ()
        )
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # after the weights (and their packed twins): on CUDA the plan measures what they left
        self.kv_plan = plan_kv_pool(
            config, self.layout, self.max_model_len, self.model, non_torch_at_start=non_torch_at_start
        )
        if self.group.world > 1:  # a group's ranks share one block manager (the leader's): the smallest pool
            agreed = self.group.agree_min("kv_blocks", self.kv_plan.num_blocks)
            if agreed != self.kv_plan.num_blocks:
                budget = f"{self.kv_plan.budget}, the group's smallest rank: {agreed} blocks"
                self.kv_plan = replace(self.kv_plan, num_blocks=agreed, budget=budget)
        self._plan_groups(mc.num_layers, mc.layer_windows)
        backend, why_not = choose_backend(config.cuda_graphs, self.device, self.kernels)
        if backend is not None and self.group.world > 1:
            # the step's collectives would be captured too: not verified on NCCL yet, impossible on gloo
            backend, why_not = None, f"off (a worker group of {self.group.world} ranks: collectives not captured)"
        if graph_backend is not None and config.cuda_graphs:
            backend = graph_backend
        if config.ep > 1 and backend is not None:  # the EP combine reads pair counts on the host per layer
            backend, why_not = None, "off (expert parallelism, ep > 1: its combine is not capturable)"
        if self.model.config.windows and backend is not None:  # the graphs' metadata has no windowed views yet
            backend, why_not = None, "off (sliding-window layers: not captured yet)"
        # With graphs the pool gets one block more than the plan, the scratch block padded rows write to: the
        # block manager hands out ids 0..plan-1 only, so the scratch block (id = plan) is nobody's.
        shared = self._share_pool(config.kv_shared_memory)
        self.pools = [
            KVPool(g.layout(self.layout), p.num_blocks + (backend is not None), self.device, shared)
            for g, p in zip(self.kv_groups, self.kv_plans, strict=True)
        ]
        return backend, why_not

    def _share_pool(self, wanted: bool) -> bool:
        """Whether the pool goes in shared memory (EngineConfig.kv_shared_memory), where that is supported."""
        why_not = None
        if not wanted:
            return False
        if self.device.type != "cpu":
            why_not = f"the pool is on {self.device}"
        elif len(self.kv_groups) > 1:
            why_not = f"{len(self.kv_groups)} KV cache groups (their hand-offs are exports)"
        elif self.group.world > 1:
            why_not = "a worker group's ranks hold head slices (pulled rank by rank)"
        if why_not is not None:
            log.info("KV pool in shared memory: off (%s)", why_not)
        else:
            log.info("KV pool in shared memory: a sealed memfd, which same-host decode workers map read-only")
        return why_not is None

    @property
    def pool(self) -> KVPool:
        """Group 0's pool (the only one of a one-group model): derived, so replacing `pools[0]` (a worker
        group's mirrored pool) cannot leave a second reference behind."""
        return self.pools[0]

    def _plan_groups(self, num_layers: int, layer_windows: tuple[int | None, ...]) -> None:
        """Split the KV plan between the model's KV cache groups (sets kv_groups, kv_plans); one group: the plan
        as it is. Logs the start-up line."""
        self.kv_groups: tuple[KVGroup, ...] = kv_groups(num_layers, layer_windows)
        if len(self.kv_groups) > 1 and self.group.world > 1:
            # a worker group's ranks mirror one pool and send one table per step (step_inputs.py): not grouped
            # yet, so the hybrid model keeps one pool of every layer there, as before groups (nothing freed)
            log.info(
                "KV cache groups: off on a worker group of %d ranks (one pool, every block kept)", self.group.world
            )
            self.kv_groups = (KVGroup(tuple(range(num_layers)), None),)
        if len(self.kv_groups) == 1:
            self.kv_plans: list[KvPlan] = [self.kv_plan]
            log.info("%s", self.kv_plan.summary())
            return
        b = self.config.block_size
        chunk = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        needs = []
        for g in self.kv_groups:
            full = -(-self.max_model_len // b)
            per_request = full if g.window is None else min(full, window_live_blocks(g.window, b, chunk))
            name = "full" if g.window is None else f"window {g.window}"
            needs.append(GroupNeed(name, g.layout(self.layout).bytes_per_block, per_request))
        self.kv_plans = split_plan(self.kv_plan, needs)
        self.kv_plan = self.kv_plans[0]
        log.info("%s", grouped_summary(needs, self.kv_plans))

    def _group_caches(self) -> list[torch.Tensor]:
        """Per model layer, its (P, N_g, B, KVH, hd) view of its KV cache group's pool."""
        caches: list[torch.Tensor | None] = [None] * self.model.config.num_layers
        for g, pool in zip(self.kv_groups, self.pools, strict=True):
            for layer, cache in zip(g.layers, pool.layer_caches(), strict=True):
                caches[layer] = cache
        assert all(c is not None for c in caches)
        return [c for c in caches if c is not None]

    def _capture(self, backend: GraphBackend | None, why_not: str) -> DecodeGraphs | None:
        """The decode graphs, captured over the real pool (after it exists), and the one start-up line."""
        if backend is None:
            log.info("decode graphs: %s", why_not)
            return None
        graphs = DecodeGraphs(
            self.model,
            self.pool.layer_caches(),
            self.config.block_size,
            scratch_block=self.kv_plan.num_blocks,
            max_model_len=self.max_model_len,
            sizes=bucket_sizes(self.config.scheduler.max_num_seqs),
            backend=backend,
        )
        try:
            self.graph_capture = graphs.capture()
        except Exception:  # a first GPU run should not be stopped by an op that refuses capture: run eagerly
            log.exception("decode graphs: capture failed (%s); every step runs eagerly", backend.name)
            return None
        log.info("%s", self.graph_capture.summary())
        return graphs

    @classmethod
    def from_dir(cls, model_dir: str | Path, graph_backend: GraphBackend | None = None, **overrides) -> Engine:
        return cls(EngineConfig(model=str(model_dir), **overrides), graph_backend=graph_backend)

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for an empty, too long or out-of-vocabulary prompt, or a
        duplicate id. With hold_kv the blocks outlive the request until `release_kv`. `output_token_ids`
        continues a request started elsewhere: prompt and those tokens are recomputed, then it samples on."""
        self._validate(request_id, prompt_token_ids + (output_token_ids or []))
        req = Request(request_id, list(prompt_token_ids), params, hold_kv=hold_kv)
        req.output_token_ids = list(output_token_ids or [])
        self.structured.add(request_id, params.structured, req.output_token_ids)  # replays the output so far
        self.requests[request_id] = req
        self.scheduler.add(req)

    def add_group(self, prompt_token_ids: list[int], choices: list[Choice], hold_kv: bool = False) -> None:
        """Queue n choices of one prompt (shared/engine/fork.py). Fresh choices (no tokens yet): the first
        computes the prompt once, and at its first token the others are forked from its KV, each sampling its
        first token from the same logits with its own parameters. Choices that carry tokens (a migrated group:
        each has its own tokens after the prompt) are queued as separate requests. Raises ValueError as
        add_request does, or for a group that mixes fresh and continued choices; nothing is queued then."""
        fresh = [not c.output_token_ids for c in choices]
        if any(fresh) and not all(fresh):
            raise ValueError("a group's choices are either all fresh or all continued")
        ids = [c.request_id for c in choices]
        if not choices or len(set(ids)) != len(ids):
            raise ValueError("a group needs at least one choice, with distinct ids")
        for c in choices:
            self._validate(c.request_id, prompt_token_ids + list(c.output_token_ids))
        if not all(fresh) or len(choices) == 1:
            for c in choices:
                self.add_request(c.request_id, prompt_token_ids, c.params, hold_kv, list(c.output_token_ids))
            return
        parent, *children = choices
        # the parent holds its blocks past its own end until the children are forked from them
        self.add_request(parent.request_id, prompt_token_ids, parent.params, hold_kv=True)
        self.pending_forks.add(parent.request_id, children, hold_kv)

    def fork(self, parent_id: str, children: list[Choice]) -> list[RequestOutput]:
        """Fork choices that have sampled tokens (elsewhere: a decode worker after importing the prompt's KV)
        from a request whose KV covers its prompt: they share its full prompt blocks and copy the partial one.
        Returns an output for each child its tokens already ended. Raises KeyError for an unknown parent,
        ValueError for a parent without its prompt's KV or a child without tokens (nothing forked then)."""
        parent = self.requests[parent_id]
        for c in children:
            self._validate(c.request_id, parent.prompt_token_ids + list(c.output_token_ids))
        made = fork_children(self.scheduler, self.pools, parent, children, hold_kv=parent.hold_kv)
        self._register_children(made)
        return [self._output(r, r.output_token_ids[-1:], None) for r in made if r.is_finished]

    def _register_children(self, made: list[Request]) -> None:
        """Put forked children in the engine: the live ones (each with its own grammar matcher when constrained,
        replaying its tokens), and finished ones that hold (no block: their release_kv only forgets them)."""
        for req in made:
            if not req.is_finished:
                self.structured.add(req.request_id, req.params.structured, req.output_token_ids)
            if not req.is_finished or req.hold_kv:
                self.requests[req.request_id] = req

    def _fork_at_first_token(self, parent: Request, logits: torch.Tensor) -> list[RequestOutput]:
        """The parent just sampled its first token: sample each child's from the same logits row, fork them,
        and give the parent's blocks back if it only held them for the fork. The children's first outputs."""
        pending = self.pending_forks.pop(parent.request_id)
        assert pending is not None  # step() calls this for a parent in pending_forks only
        if not pending.children:  # every child was aborted meanwhile
            parent.hold_kv = pending.parent_holds_kv
            if parent.is_finished and not parent.hold_kv:
                self.release_kv(parent.request_id)
            return []
        params = [c.params for c in pending.children]
        rows = logits.unsqueeze(0).expand(len(params), -1)
        history = (parent.prompt_token_ids, [])  # penalties count the prompt and nothing generated yet
        tokens, logprobs = self.runner.sampler.sample_with_logprobs(
            rows, params, [0] * len(params), [history] * len(params)
        )
        children = [Choice(c.request_id, c.params, (t,)) for c, t in zip(pending.children, tokens, strict=True)]
        first_logprobs = {c.request_id: lp for c, lp in zip(pending.children, logprobs, strict=True)}
        made = fork_children(self.scheduler, self.pools, parent, children, hold_kv=pending.parent_holds_kv)
        parent.hold_kv = pending.parent_holds_kv
        if parent.is_finished and not parent.hold_kv:
            self.release_kv(parent.request_id)
        self._register_children(made)
        outputs = []
        for r in made:
            r.prompt_logprobs = list(parent.prompt_logprobs)  # the same prompt: echo's logprobs for every choice
            lp = first_logprobs.get(r.request_id)
            outputs.append(self._output(r, r.output_token_ids, None if lp is None else [lp]))
        return outputs

    def _validate(self, request_id: str, tokens: list[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        vocab = self.model.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (held ones too). False if the id is unknown. A group's choice can be
        aborted at any stage: a child not forked yet is dropped, a parent before its first token hands the prompt
        to the next choice (shared/engine/fork.py)."""
        req = self.requests.pop(request_id, None)
        self.structured.remove(request_id)
        self.layer_streams.drop(request_id)  # a stream of its KV fails (its sender frees nothing twice)
        if req is None:
            return self.pending_forks.drop_child(request_id)  # a child not forked yet holds nothing
        if req.is_finished:  # held for export
            self.scheduler.release(req)
        else:
            self.scheduler.abort(req)
        pending = self.pending_forks.pop(request_id)
        if pending is not None and pending.children:  # a parent before its first token: the next choice takes over
            heir, *rest = pending.children
            self.add_group(req.prompt_token_ids, [heir, *rest], hold_kv=pending.parent_holds_kv)
        return True

    def can_stream_kv(self) -> bool:
        """Whether this engine can stream a request's KV layer by layer (layer_streams.py): a host-memory pool,
        one process (no worker group), no sliding windows."""
        mc = self.model.config
        return self.pool.tensor.device.type == "cpu" and self.worker_group is None and not mc.layer_windows

    def stream_kv(self, request_id: str, on_start: OnStart) -> None:
        """Watch a request added with hold_kv: when the step that completes its prompt starts, `on_start` is called
        (on this thread) with its blocks and the per-layer progress a sender waits on. ValueError where the
        engine cannot stream (`can_stream_kv`) or the request is unknown."""
        if not self.can_stream_kv():
            raise ValueError("this engine cannot stream KV layer by layer (CUDA pool, worker group or windows)")
        req = self.requests.get(request_id)
        if req is None or not req.hold_kv or req.output_token_ids:
            raise ValueError(f"request {request_id!r} is not a fresh prefill holding its KV")
        self.layer_streams.watch(request_id, on_start)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the new token of every request that produced one."""
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
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
        self.stats.steps += 1
        for s in plan.seqs:
            req = s.request  # a decode feeds back the last sampled token; a 1-token prompt is a prefill
            if s.num_tokens == 1 and req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += s.num_tokens
        outputs = []
        for r in self.scheduler.update_from_output(plan, out.sampled):
            req = r.request
            self.structured.accept(req.request_id, r.new_token_id)
            if r.finished:
                self.structured.remove(req.request_id)
            if r.finished and not req.hold_kv:
                self.requests.pop(req.request_id, None)
            logprobs = out.logprobs.get(req.request_id)
            outputs.append(self._output(req, [r.new_token_id], None if logprobs is None else [logprobs]))
            if req.request_id in self.pending_forks:  # a group's parent sampled its first token
                outputs += self._fork_at_first_token(req, out.logits[req.request_id])
        self.layer_streams.end(out.sampled)  # last: a stream's sender may free the request once it ends
        return outputs

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """The output of `req`'s new `tokens` (their logprobs when asked), with the prompt's logprobs on its first."""
        new, token_logprobs = list(tokens), logprobs
        if req.params.max_tokens == 0:  # score only: the prompt was computed, the token it sampled is dropped
            req.output_token_ids.pop()
            new, token_logprobs, req.finish_reason = [], None, FinishReason.LENGTH
        prompt_lp = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lp, req.prompt_logprobs_sent = list(req.prompt_logprobs), True
        return RequestOutput(
            req.request_id,
            new,
            req.is_finished,
            req.finish_reason,
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.scheduled_at,
            token_logprobs,
            prompt_lp,
        )

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

    # ---- KV hand-off ----------------------------------------------------------------------------------

    def export_kv(
        self, request_id: str, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    ) -> KVExport:
        """Copy out the KV of a request that is decoding or finished holding its KV. No state changes.
        `alloc(shape, dtype)` supplies the memory to copy into (e.g. a reused buffer). Several KV cache groups:
        each group's held blocks, concatenated flat (KVExport.parts)."""
        num_tokens, held = self.group_kv_blocks(request_id)
        if len(held) == 1:
            first, block_ids = held[0]
            out = None
            if alloc is not None:
                out = alloc(self.layout.block_shape(len(block_ids)), self.layout.torch_dtype)
            return KVExport(self.layout, num_tokens, self.pool.read(block_ids, out=out), first_block=first)
        parts = tuple(
            KVPart(len(g.layers), first, len(ids)) for g, (first, ids) in zip(self.kv_groups, held, strict=True)
        )
        size = sum(math.prod(pool.layout.block_shape(p.num_blocks)) for pool, p in zip(self.pools, parts, strict=True))
        dtype = self.layout.torch_dtype
        flat = alloc((size,), dtype) if alloc is not None else torch.empty(size, dtype=dtype, device=self.device)
        kv = KVExport(self.layout, num_tokens, flat, parts=parts)
        for i, (pool, (_, ids)) in enumerate(zip(self.pools, held, strict=True)):
            pool.read(ids, out=kv.part_blocks(i))
        return kv

    def kv_blocks(self, request_id: str) -> tuple[int, list[int], int]:
        """(tokens computed, the pool blocks holding them in order, the request's block they start at) of a
        request that is decoding or finished holding its KV: what `export_kv` copies, for a caller that reads
        the pool itself (a send straight from the blocks). Blocks freed behind the sliding window are not
        among them (they start at the first unfreed one). The blocks stay the request's; nothing changes.
        One KV cache group only (ValueError otherwise: export those)."""
        if len(self.pools) > 1:
            raise ValueError("a model of several KV cache groups sends exports (export_kv), not one pool's blocks")
        num_tokens, ((first, block_ids),) = self.group_kv_blocks(request_id)
        return num_tokens, block_ids, first

    def group_kv_blocks(self, request_id: str) -> tuple[int, list[tuple[int, list[int]]]]:
        """(tokens computed, per KV cache group (its first held block, the pool blocks from there on)) of a
        request that is decoding or finished holding its KV. Nothing changes."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if req.status is RequestStatus.WAITING or req.num_computed_tokens < req.num_tokens - 1:
            raise ValueError(f"request {request_id!r} has not finished its prefill")
        n = self.blocks.blocks_for(req.num_computed_tokens)
        held = []
        for table in self.scheduler.tables(req):
            first = table.freed  # blocks freed behind the sliding window are not carried
            if FREED in table.blocks[first:n]:
                raise AssertionError(f"request {request_id!r} has freed blocks past its first {first}")
            held.append((first, list(table.blocks[first:n])))
        return req.num_computed_tokens, held

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a finished request that held them. False if there is no such request."""
        req = self.requests.get(request_id)
        if req is None or not req.is_finished:
            return False
        del self.requests[request_id]
        self.scheduler.release(req)
        return True

    def import_kv(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: KVExport,
    ) -> None:
        """Continue a request from KV computed elsewhere. The KV must cover every token but the last
        sampled one. Raises NoFreeBlocksError (nothing taken) when the pool is full: retry later."""
        self._validate(request_id, prompt_token_ids)
        if not output_token_ids:
            raise ValueError("import needs at least the first sampled token")
        if kv.layout.fingerprint != self.layout.fingerprint:
            raise ValueError(f"KV layout {kv.layout} does not match this engine's {self.layout}")
        if kv.layout.held_kv_heads != self.layout.held_kv_heads:
            raise ValueError(
                f"KV of KV heads {kv.layout.held_kv_heads} cannot fill this pool of heads {self.layout.held_kv_heads}: "
                "re-slice it to this rank's heads first"
            )
        if kv.num_tokens != len(prompt_token_ids) + len(output_token_ids) - 1:
            raise ValueError(
                f"KV covers {kv.num_tokens} tokens; expected prompt + output - 1 = "
                f"{len(prompt_token_ids) + len(output_token_ids) - 1}"
            )
        if len(self.scheduler.running) >= self.config.scheduler.max_num_seqs:
            raise NoFreeBlocksError(f"{self.config.scheduler.max_num_seqs} requests already running")
        if kv.parts and len(kv.parts) != len(self.pools):
            raise ValueError(
                f"KV of {len(kv.parts)} KV cache groups cannot fill this engine's pool of {len(self.pools)}: a "
                "hybrid model's grouped KV goes to single-rank engines"
            )
        tables = self._allocate_import(kv)
        try:  # the matcher replays the output so far (the prefill worker sampled the first token under it)
            self.structured.add(request_id, params.structured, output_token_ids)
        except ValueError:
            for blocks, table in zip(self.group_blocks, tables, strict=True):
                blocks.free(table.blocks)
            raise
        try:
            self._write_import(kv, tables)
        except BaseException:  # e.g. a borrowed KV whose lender took it back mid-copy (BorrowRevoked): nothing kept
            self.structured.remove(request_id)
            for blocks, table in zip(self.group_blocks, tables, strict=True):
                blocks.free(table.blocks)
            raise
        req = Request(request_id, list(prompt_token_ids), params, output_token_ids=list(output_token_ids))
        req.group_tables = tables
        req.num_computed_tokens = kv.num_tokens
        self.requests[request_id] = req
        self.scheduler.add_running(req)

    def _write_import(self, kv: KVExport, tables: list[GroupTable]) -> None:
        """Write an imported request's KV into the blocks `_allocate_import` gave it, in every KV cache group."""
        if len(self.pools) == 1:
            self.pool.write_export(tables[0].blocks[tables[0].freed :], kv)  # a worker group: on every rank
        elif not kv.parts:  # from one pool of every layer (a worker group's): each group takes its layers
            data = kv.reblock(self.layout.block_size)
            for g, pool, table in zip(self.kv_groups, self.pools, tables, strict=True):
                pool.write(table.blocks[table.freed :], data[list(g.layers)])
        else:
            for i, (pool, table) in enumerate(zip(self.pools, tables, strict=True)):
                pool.write(table.blocks[table.freed :], kv.reblock(self.layout.block_size, i))

    def _allocate_import(self, kv: KVExport) -> list[GroupTable]:
        """Every group's table for an imported request: FREED up to the group's first carried block (behind its
        window), fresh blocks from there on. All or nothing: NoFreeBlocksError with nothing taken."""
        n = self.blocks.blocks_for(kv.num_tokens)
        firsts = [kv.first_block_at(self.layout.block_size, i if kv.parts else None) for i in range(len(self.pools))]
        if not kv.parts and kv.first_block and len(self.pools) > 1:
            raise ValueError("KV of one pool without its first blocks cannot fill a full-attention group")
        if not all(b.can_allocate(n - f) for b, f in zip(self.group_blocks, firsts, strict=True)):
            free = [b.num_free for b in self.group_blocks]
            raise NoFreeBlocksError(f"an import of {kv.num_tokens} tokens does not fit: free blocks per group {free}")
        return [GroupTable([FREED] * f + b.allocate(n - f), f) for b, f in zip(self.group_blocks, firsts, strict=True)]

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every block's reference count is the number of live requests whose
        tables hold it (forked choices share prompt blocks), so no block is free while held, nor held by
        nobody. In every KV cache group."""
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
            for b, n in enumerate(holders):
                if blocks.ref_count(b) != n:
                    raise AssertionError(f"block {b} of group {g} has {blocks.ref_count(b)} references, {n} holders")
