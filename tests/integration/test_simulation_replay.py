"""`pdserve plan`'s simulation (services/planning/simulate.py) schedules a mixed worker as the engine does.

The same requests go through the simulation and through a real engine (the tiny demo) on a virtual clock: the
replay admits a queued job whenever the worker would fetch one (`EngineLoad.has_room`, as the worker's job feed
asks), runs the engine's own step, reads what the step computed (decode tokens, prompt tokens, outputs) and
charges the step what the simulation charges such a step, from the same profile's costs. Then only the
scheduling differs: which prompts and chunks join which step, when a request decodes, when it finishes. Equal
first-token and finish times say the simulation's scheduling is the engine's; what a measured deployment adds
(the serving plane, the host's other work) is outside what this compares (docs/planning.md).
"""

from __future__ import annotations

import statistics
from collections import deque
from pathlib import Path

import pytest
import torch

from services.planning.costs import WorkerOverhead
from services.planning.model import Deployment, PerformanceModel
from services.planning.profile_file import load_profile
from services.planning.simulate import SimRequest
from services.planning.workload import from_lengths
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.worker.engine_load import EngineLoad

RECORDED = Path(__file__).parent.parent / "data" / "planning" / "profile_small_epyc.json"


def replay(
    engine: Engine, model: PerformanceModel, config: str, requests: list[SimRequest]
) -> list[tuple[float, float]]:
    """(first token, finish) times of each request served by `engine` as one mixed worker, on a virtual clock that
    charges every step the simulation's cost of a step of the same make-up."""
    costs, overhead = model.costs[config], WorkerOverhead.of(model.profile.plane.worker)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    pending, queue = deque(enumerate(requests)), deque()
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    context: dict[str, int] = {}  # a request's prompt + its output tokens so far
    now = 0.0
    while pending or queue or engine.has_unfinished():
        while pending and pending[0][1].arrival_s <= now:
            queue.append(pending.popleft())
        while queue and EngineLoad.of(engine).has_room():
            i, r = queue.popleft()
            prompt = torch.randint(0, vocab, (r.prompt_len,), generator=gen).tolist()
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                              ignore_eos=True))  # fmt: skip
            context[str(i)] = r.prompt_len
        if not engine.has_unfinished():
            now = max(now, pending[0][1].arrival_s)
            continue
        decoding = [context[rid] for rid in first if rid not in finish]
        prompts = {rid: req.num_computed_tokens for rid, req in engine.requests.items() if rid not in first}
        prefilled, decoded = engine.stats.prefill_tokens, engine.stats.decode_tokens
        outs = engine.step()
        prefilled, decoded = engine.stats.prefill_tokens - prefilled, engine.stats.decode_tokens - decoded
        assert decoded == len(decoding)  # every decoding request gets one token a step (no preemption here)
        seconds = costs.decode.step_s(decoded, statistics.fmean(decoding)) if decoded else costs.prefill.step_s
        chunks = [(start, _computed(engine, rid, context)) for rid, start in prompts.items()]
        assert sum(end - start for start, end in chunks) == prefilled
        seconds += sum(costs.prefill.chunk_s(start, end) for start, end in chunks if end > start)
        seconds += overhead.at(sum(len(o.new_token_ids) for o in outs))
        now += seconds
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                context[o.request_id] += len(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = now
    return [(first[str(i)], finish[str(i)]) for i in range(len(requests))]


def _computed(engine: Engine, rid: str, context: dict[str, int]) -> int:
    """The prompt tokens of `rid` computed after a step (all of them once it has left the engine, finished)."""
    req = engine.requests.get(rid)
    return req.num_computed_tokens if req is not None else context[rid]


@pytest.fixture(scope="module")
def model() -> PerformanceModel:
    return PerformanceModel(load_profile(RECORDED))


@pytest.fixture(scope="module")
def engine(model_dir, model):
    limits = model.profile.engine
    scheduler = SchedulerConfig(max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens)
    return Engine.build(EngineConfig(str(model_dir), max_model_len=2048, enable_prefix_caching=False, threads=1,
                                     scheduler=scheduler))  # fmt: skip


def _run(engine, model, rate: float):
    """(requests, the simulation's outcomes, the replay's (first token, finish) times) at `rate` req/s: prompts of
    192–320 tokens (two fit one step's 512-token budget, a third is chunked), 24–40 output tokens."""
    config = model.profile.configs[0].config.name
    requests = from_lengths(rate, 256, 32, 0.25).requests(48, seed=1)
    return requests, model.simulate(Deployment.colocated(config, 1), requests), replay(engine, model, config, requests)


@pytest.mark.parametrize("rate", [1.0, 3.0])
def test_the_simulation_schedules_a_mixed_worker_as_the_engine_does(engine, model, rate):
    """At 1 req/s steps mostly decode between prompts; at 3 req/s prompts queue, are chunked and share steps with
    decodes. Every request's first token and end come at the same time in both."""
    requests, simulated, replayed = _run(engine, model, rate)
    plane = model.profile.plane.ttft_s  # the simulation's TTFT counts the plane's; the engine's first token does not
    for r, o, (first, finish) in zip(requests, simulated, replayed, strict=True):
        assert o.ttft_s - plane == pytest.approx(first - r.arrival_s, rel=1e-6, abs=1e-6), r
        assert o.finish_s == pytest.approx(finish, rel=1e-6, abs=1e-6), r


def test_past_its_capacity_the_simulation_admits_a_backlog_a_job_a_step_sooner(engine, model):
    """At 8 req/s (about twice what the worker serves) a backlog waits in the queue. The two part in one thing
    only: when a step ends with jobs queued, the simulation takes one and starts the next step with it (the rest
    join the step after), where this replay admits every job the worker has room for first. (A real worker does
    neither exactly: it fetches one job at a time on its loop while the engine steps on.) The percentiles agree
    within 3%."""
    requests, simulated, replayed = _run(engine, model, 8.0)
    plane = model.profile.plane.ttft_s
    ttft = (
        [o.ttft_s - plane for o in simulated],
        [first - r.arrival_s for r, (first, _) in zip(requests, replayed, strict=True)],
    )
    tpot = (
        [o.tpot_s for o in simulated],
        [(finish - first) / (r.output_len - 1) for r, (first, finish) in zip(requests, replayed, strict=True)],
    )
    for sim, real in (ttft, tpot):
        for q in (0.5, 0.9):
            assert _percentile(sim, q) == pytest.approx(_percentile(real, q), rel=0.03)
    exact = sum(o.finish_s == pytest.approx(f, rel=1e-6) for o, (_, f) in zip(simulated, replayed, strict=True))
    assert exact < len(requests)  # the backlog did make them part (else the case above covers it)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
