"""One process's inference engine: model + KV pool + block manager + scheduler + runner.

Single-threaded by design: callers (the services) drive `step()` from one loop and call `add_request`,
`abort`, `export_kv`, `import_kv` between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.block_manager import BlockManager, NoFreeBlocksError
from shared.engine.config import EngineConfig
from shared.engine.fork import Choice, PendingForks, fork_children
from shared.engine.kv_export import KVExport
from shared.engine.kv_measure import plan_kv_pool
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler, SamplingParams
from shared.engine.scheduler import Scheduler
from shared.model.device import resolve_device
from shared.model.kernels.choice import resolve_kernels
from shared.model.linear import can_prepack, prepack
from shared.model.loader import load_model
from shared.model.transformer import CausalLM

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


@dataclass
class EngineStats:
    """Cumulative token counts, by the phase the model computed them in."""

    prefill_tokens: int = 0  # tokens computed as part of a prompt (or a recomputation)
    decode_tokens: int = 0  # single tokens fed back while decoding
    preemptions: int = 0
    steps: int = 0


class Engine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)  # refuses an unknown device or CUDA without one, first
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model or load_model(config.model, dtype=config.dtype, device=self.device)
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
        self.layout = KVLayout(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, str(dtype).removeprefix("torch.")
        )
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # after the weights (and their packed twins): on CUDA the plan measures what they left
        self.kv_plan = plan_kv_pool(config, self.layout, self.max_model_len, self.model)
        log.info("%s", self.kv_plan.summary())
        self.pool = KVPool(self.layout, self.kv_plan.num_blocks, self.device)
        self.blocks = BlockManager(self.pool.num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, eos_token_ids=mc.eos_token_ids)
        self.runner = ModelRunner(self.model, self.pool, Sampler(config.seed))
        self.requests: dict[str, Request] = {}  # live, or finished and holding KV
        self.stats = EngineStats()
        self.last_logits: dict[str, torch.Tensor] = {}  # from the latest step, for tests and logprobs
        self.pending_forks = PendingForks()  # children forked at their parent's first token

    @classmethod
    def from_dir(cls, model_dir: str | Path, **overrides) -> Engine:
        return cls(EngineConfig(model=str(model_dir), **overrides))

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
        made = fork_children(self.scheduler, self.pool, parent, children, hold_kv=parent.hold_kv)
        self._register_children(made)
        return [self._output(r, r.output_token_ids[-1:], True) for r in made if r.is_finished]

    def _register_children(self, made: list[Request]) -> None:
        """Put forked children in the engine: the live ones, and finished ones that hold (no block: their
        release_kv only forgets them)."""
        for req in made:
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
        tokens = self.runner.sampler.sample(rows, params, [0] * len(params))
        children = [Choice(c.request_id, c.params, (t,)) for c, t in zip(pending.children, tokens, strict=True)]
        made = fork_children(self.scheduler, self.pool, parent, children, hold_kv=pending.parent_holds_kv)
        parent.hold_kv = pending.parent_holds_kv
        if parent.is_finished and not parent.hold_kv:
            self.release_kv(parent.request_id)
        self._register_children(made)
        return [self._output(r, r.output_token_ids, r.is_finished) for r in made]

    def _output(self, req: Request, new_token_ids: list[int], finished: bool) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            list(new_token_ids),
            finished,
            req.finish_reason,
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.scheduled_at,
        )

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
        if req is None:
            return self.pending_forks.drop_child(request_id)  # a child not forked yet holds nothing
        if req.is_finished:  # held for export
            self.blocks.free(req.block_table)
            req.block_table = []
        else:
            self.scheduler.abort(req)
        pending = self.pending_forks.pop(request_id)
        if pending is not None and pending.children:  # a parent before its first token: the next choice takes over
            heir, *rest = pending.children
            self.add_group(req.prompt_token_ids, [heir, *rest], hold_kv=pending.parent_holds_kv)
        return True

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
        out = self.runner.execute(plan)
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
            if r.finished and not req.hold_kv:
                self.requests.pop(req.request_id, None)
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [r.new_token_id],
                    r.finished,
                    req.finish_reason,
                    len(req.prompt_token_ids),
                    len(req.output_token_ids),
                    req.scheduled_at,
                )
            )
            if req.request_id in self.pending_forks:  # a group's parent sampled its first token
                outputs += self._fork_at_first_token(req, out.logits[req.request_id])
        return outputs

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
        `alloc(shape, dtype)` supplies the memory to copy into (e.g. a reused buffer)."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if req.status is RequestStatus.WAITING or req.num_computed_tokens < req.num_tokens - 1:
            raise ValueError(f"request {request_id!r} has not finished its prefill")
        n = self.blocks.blocks_for(req.num_computed_tokens)
        out = None
        if alloc is not None:
            shape = (
                self.layout.num_layers,
                2,
                n,
                self.layout.block_size,
                self.layout.num_kv_heads,
                self.layout.head_dim,
            )
            out = alloc(shape, self.layout.torch_dtype)
        return KVExport(self.layout, req.num_computed_tokens, self.pool.read(req.block_table[:n], out=out))

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a finished request that held them. False if there is no such request."""
        req = self.requests.get(request_id)
        if req is None or not req.is_finished:
            return False
        del self.requests[request_id]
        self.blocks.free(req.block_table)
        req.block_table = []
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
        if kv.num_tokens != len(prompt_token_ids) + len(output_token_ids) - 1:
            raise ValueError(
                f"KV covers {kv.num_tokens} tokens; expected prompt + output - 1 = "
                f"{len(prompt_token_ids) + len(output_token_ids) - 1}"
            )
        if len(self.scheduler.running) >= self.config.scheduler.max_num_seqs:
            raise NoFreeBlocksError(f"{self.config.scheduler.max_num_seqs} requests already running")
        blocks = self.blocks.allocate(self.blocks.blocks_for(kv.num_tokens))
        self.pool.write(blocks, kv.reblock(self.layout.block_size))
        req = Request(request_id, list(prompt_token_ids), params, output_token_ids=list(output_token_ids))
        req.block_table = blocks
        req.num_computed_tokens = kv.num_tokens
        self.requests[request_id] = req
        self.scheduler.add_running(req)

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every block's reference count is the number of live requests whose
        tables hold it (forked choices share prompt blocks), so no block is free while held, nor held by
        nobody."""
        self.blocks.check_integrity()
        holders = [0] * self.blocks.num_blocks
        for req in self.requests.values():
            for b in req.block_table:
                if self.blocks.ref_count(b) == 0:
                    raise AssertionError(f"request {req.request_id} holds free block {b}")
                holders[b] += 1
        for b, n in enumerate(holders):
            if self.blocks.ref_count(b) != n:
                raise AssertionError(f"block {b} has {self.blocks.ref_count(b)} references, {n} holders")
