"""Executes a schedule plan: builds the flat batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.kv_pool import KVPool
from shared.engine.logprobs import TokenLogprobs
from shared.engine.prompt_scoring import plan_scoring, score
from shared.engine.request import Request
from shared.engine.request_experts import RequestExperts
from shared.engine.sampling import Sampler, SamplingParams
from shared.engine.scheduler import SchedulePlan
from shared.engine.step_clock import StepClock
from shared.engine.step_inputs import ScoredFn, StepInputs, forward_step
from shared.engine.structured import StructuredDecoding
from shared.model.device import to_device
from shared.model.transformer import CausalLM

# (inputs, on_scored) → the sampling rows' logits: forward_step on this process's model, or in a worker group
# the leader's op stream (shared/parallel/ops.py), which sends the inputs to the followers first
StepFn = Callable[[StepInputs, ScoredFn], "torch.Tensor | None"]


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id → next token, for every sequence that sampled
    logits: Mapping[str, torch.Tensor]  # request id → (V,) float32 logits the token was sampled from (on the device)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for the requests that asked


class RowLogits(Mapping[str, torch.Tensor]):
    """Request id → its row of a step's (S, V) logits, the view made when read: only a fork's first token, logprobs
    tests and tools read them, so a step makes no per-row view (S of them were ~1.5 µs each)."""

    def __init__(self, request_ids: list[str], logits: torch.Tensor) -> None:
        self._ids, self._logits = request_ids, logits
        self._rows: dict[str, int] | None = None

    def __getitem__(self, request_id: str) -> torch.Tensor:
        if self._rows is None:
            self._rows = {rid: i for i, rid in enumerate(self._ids)}
        return self._logits[self._rows[request_id]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        sampler: Sampler,
        graphs: DecodeGraphs | None = None,
        structured: StructuredDecoding | None = None,
        caches: list[torch.Tensor] | None = None,
        group_windows: tuple[int, ...] = (),
    ) -> None:
        """`caches`: per model layer its cache view, when the layers' KV lies in several KV cache groups' pools
        (shared/engine/kv_groups.py; `group_windows`: the windows of the groups after the first, in order);
        default: `pool`'s layers, one group."""
        self.model = model
        self.pool = pool
        self.sampler = sampler
        self.structured = structured  # grammar matchers of the requests with structured output
        self._caches = caches if caches is not None else pool.layer_caches()
        self.group_windows = group_windows
        self.device = pool.tensor.device
        self.graphs = graphs  # captured decode steps (decode_graphs.py); None = every step runs eagerly
        self.graph_steps = 0  # steps that replayed a graph
        self.run_step: StepFn = self._local_step  # replaced in a worker group's leader
        # per-request expert counts of the prompts that ask (decode routed by expert affinity)
        self.request_experts = RequestExperts(model)
        self.step_clock: StepClock | None = None  # the engine's (Engine.time_steps)

    def _local_step(self, inputs: StepInputs, on_scored: ScoredFn) -> torch.Tensor | None:
        block_size, clock = self.pool.layout.block_size, self.step_clock
        return forward_step(self.model, self._caches, inputs, block_size, self.device, on_scored, clock)

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> RunnerOutput:
        """One model step. Host → device: the metadata, and ids + positions + sampled rows in one copy;
        device → host: the sampled ids, in one copy (the step's only sync)."""
        if not plan.seqs:
            return RunnerOutput({}, {})
        input_ids: list[int] = []
        positions: list[int] = []
        for seq in plan.seqs:
            start = seq.request.num_computed_tokens
            input_ids += seq.request.token_slice(start, start + seq.num_tokens)
            positions += range(start, start + seq.num_tokens)
        # Only sequences that caught up sample; their last token's hidden state gives the logits.
        ends = list(itertools.accumulate(s.num_tokens for s in plan.seqs))
        sampling = [i for i, s in enumerate(plan.seqs) if s.samples]
        reqs = [plan.seqs[i].request for i in sampling]
        # grammar masks: filled in a thread while the forward runs, applied before sampling
        masks = self.structured.begin([r.request_id for r in reqs]) if self.structured else None
        # a request still scoring its prompt needs every row's hidden state: the eager path (prompt_scoring.py)
        scoring = any(_scoring_prompt(s.request) for s in plan.seqs)
        if self.graphs is not None and not scoring and self.graphs.fits([s.num_tokens for s in plan.seqs]):
            logits = self._replay(plan, input_ids, sampling)
        else:
            logits = self._eager(plan, input_ids, positions, ends, sampling)
        clock = self.step_clock
        if clock is not None:
            clock.mark("model")  # the group leader's op stream and graph replays stamp nothing inside
        if logits is None:
            return RunnerOutput({}, {})
        if self.structured is not None:
            logits = self.structured.apply(masks, logits)
        params = [r.params for r in reqs]
        # the histories only penalties read (the fast path reads none)
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in reqs] if _any_penalties(params) else None
        tokens, logprobs = self.sampler.sample_with_logprobs(
            logits, params, [len(r.output_token_ids) for r in reqs], histories
        )
        ids_ = [r.request_id for r in reqs]
        wanted = {rid: lp for rid, lp in zip(ids_, logprobs, strict=True) if lp is not None}
        out = RunnerOutput(dict(zip(ids_, tokens, strict=True)), RowLogits(ids_, logits), wanted)
        if clock is not None:
            clock.mark("sample")
        return out

    def _eager(
        self, plan: SchedulePlan, input_ids: list[int], positions: list[int], ends: list[int], sampling: list[int]
    ) -> torch.Tensor | None:
        """The model run op by op: any plan. → (S, V) float32 logits of the sampling rows, None if none."""
        slices = plan_scoring(plan.seqs, ends)  # prompt logprobs, for the requests that asked
        inputs = StepInputs(
            input_ids=input_ids,
            positions=positions,
            block_tables=[s.request.block_table for s in plan.seqs],
            context_lens=[s.request.num_computed_tokens + s.num_tokens for s in plan.seqs],
            query_lens=[s.num_tokens for s in plan.seqs],
            sample_rows=[ends[i] - 1 for i in sampling],
            score_rows=[(c.first_row, len(c.targets)) for c in slices],
            group_tables=tuple(
                (w, [s.request.group_tables[g].blocks for s in plan.seqs])
                for g, w in enumerate(self.group_windows, start=1)
            ),
        )
        if self.step_clock is not None:
            self.step_clock.mark("inputs")
        self.request_experts.before(plan.seqs, self.device)
        try:
            return self.run_step(inputs, lambda i, logits: score(slices[i], logits))
        finally:
            self.request_experts.after()

    def _replay(self, plan: SchedulePlan, input_ids: list[int], sampling: list[int]) -> torch.Tensor | None:
        """A decode-only plan through the captured graph of its bucket (one token per sequence)."""
        assert self.graphs is not None
        self.graph_steps += 1
        if self.step_clock is not None:
            self.step_clock.mark("inputs")
        logits = self.graphs.run(
            [s.request.block_table for s in plan.seqs],
            [s.request.num_computed_tokens + 1 for s in plan.seqs],
            input_ids,
        )
        if not sampling:
            return None
        if len(sampling) == len(plan.seqs):
            return logits
        return logits[to_device(torch.tensor(sampling, dtype=torch.int64), self.device)]


def _any_penalties(params: list[SamplingParams]) -> bool:
    return not all(p.plain for p in params) and any(p.has_penalties for p in params)


def _scoring_prompt(req: Request) -> bool:
    """True while a request that asked for prompt logprobs has prompt positions left to score."""
    return req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_token_ids) - 1
