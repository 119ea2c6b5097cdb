"""Executes a schedule plan: builds the flat batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.dp_step import forward_rank_step
from shared.engine.kv_pool import KVPool
from shared.engine.logprobs import TokenLogprobs
from shared.engine.prompt_scoring import plan_scoring, score
from shared.engine.request import Request
from shared.engine.request_experts import RequestExperts
from shared.engine.sampling import Sampler, SamplingParams
from shared.engine.scheduler import PENDING, SchedulePlan
from shared.engine.step_clock import StepClock
from shared.engine.step_inputs import ScoredFn, StagedStep, StepInputs, run_staged, stage_step
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


@dataclass
class PreparedStep:
    """A step made ready on the planning thread for the forward thread (overlap scheduling, overlap.py): nothing
    in it refers to a request, whose state the planning thread goes on changing while the step runs.

    `fills`: (flat row, request id, its sampling row) of the decodes whose input token is PENDING, the token
    the previous step samples for that request. A row whose filled-in token ends its request (a stop token) is
    not sampled: the request ends with the previous step, and its row here is wasted."""

    staged: StagedStep | None  # the eager path's inputs; None: the graph path's below
    inputs: StepInputs | None
    graph_tables: list[list[int]] | None  # the graph path: per sequence a copy of its block table
    context_lens: list[int]
    input_ids: list[int]  # PENDING where `fills` point
    sample_rows: list[int]  # the flat rows whose logits are sampled (on the graph path: the sequences)
    fills: list[tuple[int, str, int]]
    request_ids: list[str]  # per sampling row
    params: list[SamplingParams]
    output_positions: list[int]  # per sampling row: the index of the output token it samples


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
        return forward_rank_step(self.model, self._caches, inputs, block_size, self.device, on_scored, clock)

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

    def prepare(self, plan: SchedulePlan) -> PreparedStep:
        """`plan`'s step made ready to run without the requests (overlap.py): the forward thread runs it with
        `run_prepared`. Only plans that need no grammar, penalties, prompt scoring, expert trace or layer stream
        (the engine steps those in lockstep) and a local model (no worker group)."""
        input_ids: list[int] = []
        positions: list[int] = []
        fills: list[tuple[int, str, int]] = []
        request_ids: list[str] = []
        params: list[SamplingParams] = []
        output_positions: list[int] = []
        sample_rows: list[int] = []
        for seq in plan.seqs:
            req = seq.request
            start = req.num_computed_tokens
            input_ids += req.token_slice(start, start + seq.num_tokens)
            positions += range(start, start + seq.num_tokens)
            if input_ids[-1] == PENDING:  # only a decode's one token can be awaited
                fills.append((len(input_ids) - 1, req.request_id, len(request_ids)))
            if seq.samples:
                sample_rows.append(len(input_ids) - 1)
                request_ids.append(req.request_id)
                params.append(req.params)
                output_positions.append(len(req.output_token_ids))
        context_lens = [s.request.num_computed_tokens + s.num_tokens for s in plan.seqs]
        if self.graphs is not None and self.graphs.fits([s.num_tokens for s in plan.seqs]):
            tables = [list(s.request.block_table) for s in plan.seqs]  # the scheduler grows them in place
            staged, inputs = None, None
        else:
            tables = None
            inputs = StepInputs(
                input_ids=input_ids,
                positions=positions,
                block_tables=[s.request.block_table for s in plan.seqs],  # read now, by stage_step
                context_lens=context_lens,
                query_lens=[s.num_tokens for s in plan.seqs],
                sample_rows=sample_rows,
                score_rows=[],
                group_tables=tuple(
                    (w, [s.request.group_tables[g].blocks for s in plan.seqs])
                    for g, w in enumerate(self.group_windows, start=1)
                ),
            )
            staged = stage_step(self.model, inputs, self.pool.layout.block_size, self.device)
        return PreparedStep(
            staged, inputs, tables, context_lens, input_ids, sample_rows, fills, request_ids, params, output_positions
        )

    @torch.inference_mode()
    def run_prepared(
        self, step: PreparedStep, previous: Mapping[str, int], stops: Callable[[SamplingParams, int], bool]
    ) -> RunnerOutput:
        """Run a `prepare`d step on the forward thread: fill its PENDING ids from `previous` (the step before's
        sampled tokens), run the model, and sample every row whose request goes on (`stops`: whether a token
        ends a request by itself)."""
        dead: set[int] = set()
        if step.fills:
            tokens = [previous[rid] for _, rid, _ in step.fills]
            for (row, _, j), token in zip(step.fills, tokens, strict=True):
                step.input_ids[row] = token
                if stops(step.params[j], token):
                    dead.add(j)
            if step.staged is not None:
                rows = torch.tensor([row for row, _, _ in step.fills], dtype=torch.int64)
                step.staged.host[rows] = torch.tensor(tokens, dtype=torch.int64)
        if step.graph_tables is not None:
            assert self.graphs is not None
            self.graph_steps += 1
            logits = self.graphs.run(step.graph_tables, step.context_lens, step.input_ids)
            if len(step.sample_rows) != len(step.input_ids):  # a one-token prompt chunk that does not sample
                logits = logits[to_device(torch.tensor(step.sample_rows, dtype=torch.int64), self.device)]
        else:
            assert step.inputs is not None and step.staged is not None
            logits = run_staged(self.model, self._caches, step.inputs, step.staged, self.device)
        if logits is None or not step.request_ids:
            return RunnerOutput({}, {})
        ids_, params, positions = step.request_ids, step.params, step.output_positions
        if dead:  # these rows draw nothing: the engine's own random stream stays the one lockstep draws from
            live = [j for j in range(len(ids_)) if j not in dead]
            if not live:
                return RunnerOutput({}, {})
            logits = logits[to_device(torch.tensor(live, dtype=torch.int64), self.device)]
            ids_, params, positions = [ids_[j] for j in live], [params[j] for j in live], [positions[j] for j in live]
        tokens, logprobs = self.sampler.sample_with_logprobs(logits, params, positions)
        wanted = {rid: lp for rid, lp in zip(ids_, logprobs, strict=True) if lp is not None}
        return RunnerOutput(dict(zip(ids_, tokens, strict=True)), RowLogits(ids_, logits), wanted)

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
