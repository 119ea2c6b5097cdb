"""A discrete-event simulation of a deployment serving a list of requests, on the step costs of its workers
(costs.py). Deterministic: no randomness here (the workload's seed made the requests), ties broken by order.

What it models, as the workers do it (docs/architecture.md, docs/planning.md):

- Queues. Jobs wait in a shared queue per role (prefill jobs for prefill or mixed workers; decode jobs for decode
  workers). A worker takes the next job whenever it has room, as `EngineLoad.has_room` says (fewer than
  max_num_seqs requests, fewer waiting prompt tokens than one step's budget, KV under 90% used; a decode worker
  also at most MAX_CONCURRENT_PULLS pulls at once); among workers with room, in turn (JetStream hands a pull
  consumer's messages to the waiting fetches in order).
- Steps. A worker steps while it has work, as the engine's scheduler plans a step: every decoding request one
  token, then the prompts being prefilled, then waiting prompts in order, chunked to the step's token budget.
  A step costs the decode step of its decoding requests at their mean context (or the prefill step's overhead
  when none decode) plus the work of its prompt chunks (costs.PrefillCost), plus the worker's own time outside the
  engine by the outputs the step gives (PlaneCosts.worker, costs.WorkerOverhead), all times the pool's slowdown
  (the serving plane's CPU on the workers' cores, cpu_share.py: the model computes it). Work that arrives during a step
  joins the next one.
- Prefill worker: a prompt's first token comes at the end of the step that computed its last chunk (its TTFT
  adds the serving plane's time, PlaneCosts.ttft_s); with more than one output token its decode job then waits for
  a decode worker, which pulls the KV and decodes it from its next step on. The pull: the hops
  (PlaneCosts.handoff_s) and the pull's overhead, then the prefill worker exports the blocks on its engine's thread
  between two steps (busy, it answers when its step in progress ends: under load a hand-off waits up to a prefill
  step), then the bytes at the transfer's cost.
- Mixed worker: the same engine prefills and decodes; a prompt decodes from the step after its first token.
- A request of O output tokens finishes at the end of its (O - 1)-th decode step. TPOT = (finish - first token) /
  (O - 1), as the bench client measures it (the plane's time per token cancels out of that difference).

Not modelled: preemption (a decode pool that runs out of blocks mid-request), the prefill side's held KV, prefix
cache hits, the gateway's local prefill path (the modelled disaggregated deployments send every prompt remote).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from services.planning.costs import WorkerCosts, WorkerOverhead
from services.planning.profile_file import EngineLimits, PlaneCosts, TransferCosts

MAX_BLOCK_USAGE = 0.9  # shared/worker/engine_load.py: no job is fetched past this share of the KV blocks
MAX_CONCURRENT_PULLS = 4  # services/decode/worker.py


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int  # output tokens, the first included (>= 1)


@dataclass
class Outcome:
    """What the simulation predicts for one request (seconds from its arrival)."""

    ttft_s: float = float("nan")
    tpot_s: float = 0.0  # 0 for a single output token (as the bench client counts it)
    finish_s: float = float("nan")  # absolute time of its last token


@dataclass
class _Req:
    index: int
    prompt: int
    output: int
    computed: int = 0  # prompt tokens computed
    first_s: float = 0.0  # absolute time of its first token (engine side)
    held: int = 0  # KV tokens counted for it when its blocks were taken (its decode steps add one each)
    source: _Worker | None = None  # the prefill worker holding its KV until it is pulled


@dataclass
class _Worker:
    role: Role
    costs: WorkerCosts
    index: int
    slowdown: float = 1.0  # its steps' time over the profile's (Pool.slowdown)
    waiting: deque[_Req] = field(default_factory=deque)  # taken, not admitted
    prefilling: list[_Req] = field(default_factory=list)  # admitted, prompt not done
    decoding: list[tuple[int, int, _Req]] = field(default_factory=list)  # (its last step, index, request): a heap
    context_sum: float = 0.0  # over the decoding requests
    held_tokens: int = 0  # KV held by admitted requests, as blocks' tokens (approximately)
    pulling: int = 0
    exports: list[tuple[_Worker, _Req]] = field(default_factory=list)  # pulls waiting for this step's end
    arriving: list[_Req] = field(default_factory=list)  # imported KV, joins the next step
    steps: int = 0  # steps begun
    busy: bool = False
    busy_s: float = 0.0  # the time its steps took, all of them
    plan_chunks: list[tuple[_Req, int]] = field(default_factory=list)

    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.arriving)

    def has_room(self, limits: EngineLimits) -> bool:
        waiting_tokens = sum(r.prompt - r.computed for r in self.waiting)
        if self.running() + len(self.waiting) + self.pulling >= limits.max_num_seqs:
            return False
        if waiting_tokens >= limits.max_num_batched_tokens:
            return False
        if self.role is Role.DECODE and self.pulling >= MAX_CONCURRENT_PULLS:
            return False
        return self.held_tokens < MAX_BLOCK_USAGE * self.costs.kv_tokens


@dataclass(frozen=True)
class Pool:
    """`count` workers of one configuration in one role; `slowdown` multiplies their steps' time (the serving
    plane's CPU on their cores: cpu_share.py)."""

    role: Role
    costs: WorkerCosts
    count: int
    slowdown: float = 1.0


class Simulation:
    """One run: `run()` → an Outcome per request, in the order given."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        pools: Sequence[Pool],
        limits: EngineLimits,
        transfer: TransferCosts,
        plane: PlaneCosts,
    ) -> None:
        roles = {p.role for p in pools if p.count > 0}
        if roles not in ({Role.MIXED}, {Role.PREFILL, Role.DECODE}):
            raise ValueError("a deployment is mixed workers only, or prefill and decode workers (at least one each)")
        self.requests = requests
        self.limits, self.transfer, self.plane = limits, transfer, plane
        self.overhead = WorkerOverhead.of(plane.worker)
        self.workers: dict[Role, list[_Worker]] = {r: [] for r in Role}
        for pool in pools:
            for _ in range(pool.count):
                ws = self.workers[pool.role]
                ws.append(_Worker(pool.role, pool.costs, len(ws), pool.slowdown))
        self.front = Role.MIXED if Role.MIXED in roles else Role.PREFILL
        self.queues: dict[Role, deque[_Req]] = {Role.PREFILL: deque(), Role.DECODE: deque(), Role.MIXED: deque()}
        self.turn: dict[Role, int] = dict.fromkeys(Role, 0)
        self.outcomes = [Outcome() for _ in requests]
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.now = 0.0

    # ---- events ------------------------------------------------------------------------------------------------

    def _at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, what))

    def run(self) -> list[Outcome]:
        for i, r in enumerate(self.requests):
            if r.output_len < 1 or r.prompt_len < 1:
                raise ValueError(f"request {i}: prompt and output lengths must be at least 1")
            self._at(r.arrival_s, "arrive", _Req(i, r.prompt_len, r.output_len))
        while self._events:
            self.now, _, kind, what = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(what, _Req)
                self.queues[self.front].append(what)
                self._dispatch(self.front)
            elif kind == "step":
                assert isinstance(what, _Worker)
                self._end_step(what)
            elif kind == "export":
                decoder, req = what  # type: ignore[misc]
                self._export(decoder, req)
            elif kind == "pulled":
                worker, req = what  # type: ignore[misc]
                worker.pulling -= 1
                worker.arriving.append(req)
                self._start_step(worker)
        return self.outcomes

    def _dispatch(self, role: Role) -> None:
        """Hand queued jobs of `role` to its workers with room, in turn."""
        queue, workers = self.queues[role], self.workers[role]
        while queue and workers:
            n = len(workers)
            for k in range(n):
                w = workers[(self.turn[role] + k) % n]
                if w.has_room(self.limits):
                    break
            else:
                return
            self.turn[role] = (w.index + 1) % n
            self._take(w, queue.popleft())

    def _take(self, w: _Worker, req: _Req) -> None:
        if w.role is Role.DECODE:  # the pull asks the prefill worker for the KV after the hops and its overhead
            w.pulling += 1
            self._at(self.now + self.plane.handoff_s + self.transfer.overhead_s, "export", (w, req))
            return
        w.waiting.append(req)
        self._start_step(w)

    def _export(self, decoder: _Worker, req: _Req) -> None:
        """The prefill worker exports a held request's blocks on its engine's thread, between two steps: a busy
        one answers when its step ends (PrefillKv / transfer/source.py export_kv go through the engine thread)."""
        source = req.source
        if source is not None and source.busy:
            source.exports.append((decoder, req))
            return
        t = self.transfer
        self._at(self.now + req.prompt * t.bytes_per_token * t.s_per_byte, "pulled", (decoder, req))

    # ---- a worker's steps ----------------------------------------------------------------------------------------

    def _start_step(self, w: _Worker) -> None:
        if w.busy:
            return
        for req in w.arriving:  # imported KV: decoding from this step on
            self._join_decode(w, req, from_step=w.steps)
        w.arriving.clear()
        budget = self.limits.max_num_batched_tokens
        decodes = len(w.decoding)
        budget -= decodes
        chunks: list[tuple[_Req, int]] = []
        for req in w.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt - req.computed, budget)
            chunks.append((req, n))
            budget -= n
        while w.waiting and budget > 0 and w.running() < self.limits.max_num_seqs:
            req = w.waiting[0]
            n = req.prompt - req.computed
            if n > budget and not self.limits.chunked_prefill:
                break
            w.waiting.popleft()
            w.prefilling.append(req)
            self._hold(w, req, req.prompt)
            n = min(n, budget)
            chunks.append((req, n))
            budget -= n
        if not decodes and not chunks:
            return
        costs = w.costs
        seconds = costs.decode.step_s(decodes, w.context_sum / decodes) if decodes else costs.prefill.step_s
        tokens = decodes + sum(1 for req, n in chunks if req.computed + n >= req.prompt)  # outputs this step gives
        seconds += self.overhead.at(tokens)
        seconds += sum(costs.prefill.chunk_s(req.computed, req.computed + n) for req, n in chunks)
        seconds *= w.slowdown
        w.busy, w.plan_chunks = True, chunks
        w.busy_s += seconds
        w.steps += 1
        self._at(self.now + seconds, "step", w)

    def _end_step(self, w: _Worker) -> None:
        """The step's outputs; then, no longer busy, the worker takes what it has room for and steps on."""
        step = w.steps - 1  # the step that ended
        w.context_sum += len(w.decoding)  # every decoding request grew by one token
        w.held_tokens += len(w.decoding)
        while w.decoding and w.decoding[0][0] <= step:
            _, _, req = heapq.heappop(w.decoding)
            self._finish(w, req)
        for req, n in w.plan_chunks:
            req.computed += n
            if req.computed >= req.prompt:
                w.prefilling.remove(req)
                self._first_token(w, req)
        w.plan_chunks = []
        w.busy = False
        exports, w.exports = w.exports, []
        for decoder, req in exports:  # the engine thread's commands run before its next step
            self._export(decoder, req)
        self._dispatch(w.role)
        self._start_step(w)

    def _first_token(self, w: _Worker, req: _Req) -> None:
        req.first_s = self.now
        out = self.outcomes[req.index]
        out.ttft_s = self.now + self.plane.ttft_s - self.requests[req.index].arrival_s
        if req.output == 1:
            out.finish_s = self.now
            w.held_tokens -= req.held
            return
        if w.role is Role.MIXED:  # the same engine decodes it, its blocks already counted
            self._join_decode(w, req, from_step=w.steps)
            return
        w.held_tokens -= req.held  # held until pulled: its blocks' share of the pool is not modelled
        req.source = w
        self.queues[Role.DECODE].append(req)
        self._dispatch(Role.DECODE)

    def _join_decode(self, w: _Worker, req: _Req, from_step: int) -> None:
        """`req` decodes in steps from_step .. from_step + output - 2 (its first token came from its prefill)."""
        heapq.heappush(w.decoding, (from_step + req.output - 2, req.index, req))
        w.context_sum += req.prompt + 1
        if w.role is Role.DECODE:  # imported: blocks for the prompt and the first token
            self._hold(w, req, req.prompt + 1)

    def _finish(self, w: _Worker, req: _Req) -> None:
        out = self.outcomes[req.index]
        out.finish_s = self.now
        out.tpot_s = (self.now - req.first_s) / (req.output - 1)
        w.context_sum -= req.prompt + req.output
        w.held_tokens -= req.held + req.output - 1

    def busy_cores(self) -> float:
        """After run(): the cores the workers kept busy on average, from 0 to the last request's end (a worker of
        U units counts U while it steps)."""
        end = max((o.finish_s for o in self.outcomes), default=0.0)
        if end <= 0:
            return 0.0
        return sum(w.busy_s * w.costs.units for ws in self.workers.values() for w in ws) / end

    def _hold(self, w: _Worker, req: _Req, tokens: int) -> None:
        """Count the blocks `tokens` take in w's pool as `req`'s."""
        bs = self.limits.block_size
        req.held = -(-tokens // bs) * bs
        w.held_tokens += req.held


def simulate(
    requests: Sequence[SimRequest],
    pools: Sequence[Pool],
    limits: EngineLimits,
    transfer: TransferCosts,
    plane: PlaneCosts,
) -> list[Outcome]:
    """Each request's predicted TTFT, TPOT and finish time on the deployment `pools` (see the module)."""
    return Simulation(requests, pools, limits, transfer, plane).run()
