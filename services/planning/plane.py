"""`pdserve profile --serving-plane`: what the serving plane and the workers' own loops add to the engines' time,
measured on a local stack (private NATS and Redis, the gateway, one prefill and one decode worker of the profile's
first configuration, pinned to disjoint cores when there are enough; prefix caching off, every prompt remote).

Requests through the OpenAI API (the bench client, services/bench), against the profile's engine costs:
- batches: B requests sent at once (B = 1, then BATCHES), long enough outputs that all B decode together for a
  while; the median inter-token gap while all B decode, less one decode step of B at their context, is the
  worker's time outside the engine in a step of B outputs (each output is handed to the loop and published as a
  token event, on the worker's own cores): the profile's `plane.worker` points (B, seconds);
- plane TTFT = the median of (a lone request's TTFT - its prompt's prefill alone, costs.PrefillCost.alone_s, and
  the per-step and per-token time of its prefill steps): HTTP, the gateway, the job's publish and fetch, the token
  event's way back;
- plane hand-off = the median of (a lone request's first inter-token gap - one decode step and its per-step time -
  the pull's modelled cost): the decode job's publish and fetch, the Redis lookup, the import.
- plane CPU = the CPU seconds of the gateway, NATS and Redis (from /proc) over each probe phase (the lone requests,
  each batch), fitted as per_request · requests + per_token · output tokens; the same for this process, the
  probes' client (`client_cpu_s_*`): cpu_share.py turns them into the workers' slowdown where they share cores.
All are clamped at 0; the profile keeps the raw figures in its `plane.source` text.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestRecord
from services.bench.prompts import PromptMaker
from services.bench.runner import BenchConfig, run
from services.local.infra import free_port
from services.local.proc_cpu import cpu_seconds
from services.local.stack import Stack, StackSpec
from services.planning.costs import WorkerCosts, WorkerOverhead
from services.planning.profile import ProfileRequest
from services.planning.profile_file import PlaneCosts, Profile
from shared.model.tokenizer import Tokenizer

PROBE_OUTPUT = 16  # tokens of a lone request: the first gap is the hand-off's, the later ones decode steps
BATCHES = (4, 16)  # requests sent at once
BATCH_PROMPT, BATCH_OUTPUT = 32, 96
WARMUPS = 2


@dataclass(frozen=True)
class PlaneSample:
    """A lone request."""

    prompt: int
    ttft_s: float
    first_gap_s: float
    later_gaps_s: tuple[float, ...]  # the gaps after the first: decode steps of one sequence


@dataclass(frozen=True)
class CpuSample:
    """One probe phase: what it served and the CPU seconds the plane's processes and the client spent on it."""

    requests: int
    tokens: int  # output tokens
    plane_s: float  # gateway, NATS, Redis
    client_s: float  # this process: the probes' client


@dataclass(frozen=True)
class BatchSample:
    """B requests decoding together: the median gap while all B decode, at their mean context then."""

    batch: int
    gap_s: float
    context: float


def _spec(profile: Profile, req: ProfileRequest) -> StackSpec:
    config = profile.configs[0].config
    cpus = sorted(os.sched_getaffinity(0))
    units = config.units
    pinned = {}
    if 2 * units <= len(cpus):  # each worker on cores of its own, as a deployment would run them
        pinned = {"prefill": tuple(cpus[:units]), "decode": tuple(cpus[units : 2 * units])}
    return StackSpec(
        model=req.model,
        port=free_port(),
        prefill=1,
        decode=1,
        threads={"prefill": units, "decode": units},
        cpu_affinity=pinned,
        parallel={role: (config.tp, config.ep) for role in ("prefill", "decode")} if config.ranks > 1 else {},
        worker_args=("--no-prefix-caching",),
        env={"PDSERVE_PREFILL_PATH": "remote"},
    )


def sample_plane(
    profile: Profile, req: ProfileRequest, lengths: tuple[int, ...] = (32, 128), repeats: int = 3
) -> tuple[list[PlaneSample], list[BatchSample], list[CpuSample]]:
    """Lone requests of each prompt length (`repeats` each, after warm-ups), then a batch of each size; the CPU of
    each of those phases."""
    stack = Stack(_spec(profile, req))
    stack.start(ready_timeout_s=300)
    try:
        maker, rng = PromptMaker(Tokenizer(req.model)), np.random.default_rng(req.seed)
        config = BenchConfig(base_url=stack.url, model=stack_model_name(req.model), progress=False, timeout_s=120)

        def send(length: int, output: int, n: int = 1) -> list[RequestRecord]:
            reqs = [BenchRequest(*maker.make(length, rng), output) for _ in range(n)]
            records = run(config, reqs).records
            for rec in records:
                if not rec.success:
                    raise RuntimeError(f"a serving-plane probe failed: {rec.error}\n{stack.logs()}")
            return records

        cpu: list[CpuSample] = []

        def timed(phase: Callable[[], list[RequestRecord]]) -> list[RequestRecord]:
            plane0, client0 = _plane_cpu_s(stack), cpu_seconds(os.getpid())
            records = phase()
            tokens = sum(r.output_tokens for r in records)
            plane, client = _plane_cpu_s(stack) - plane0, cpu_seconds(os.getpid()) - client0
            cpu.append(CpuSample(len(records), tokens, plane, client))
            return records

        for _ in range(WARMUPS):
            send(lengths[0], PROBE_OUTPUT)
        probes = timed(lambda: [send(n, PROBE_OUTPUT)[0] for n in lengths for _ in range(repeats)])
        lone = [PlaneSample(r.prompt_len, r.ttft_s, r.itl_s[0], tuple(r.itl_s[1:])) for r in probes]
        batches = [together(b, timed(lambda b=b: send(BATCH_PROMPT, BATCH_OUTPUT, b))) for b in BATCHES]
        return lone, [b for b in batches if b is not None], cpu
    finally:
        stack.stop()


def together(batch: int, records: list[RequestRecord]) -> BatchSample | None:
    """The gaps of `records` while all of them were decoding (None if they never all were)."""
    firsts = [r.start_s + r.ttft_s for r in records]
    ends = [r.start_s + r.latency_s for r in records]
    lo, hi = max(firsts), min(ends)
    gaps, contexts = [], []
    for r, first in zip(records, firsts, strict=True):
        t, produced = first, 1
        for gap in r.itl_s:
            if lo <= t and t + gap <= hi:
                gaps.append(gap)
                contexts.append(r.prompt_len + produced)
            t, produced = t + gap, produced + 1
    if len(gaps) < batch:
        return None
    return BatchSample(batch, statistics.median(gaps), statistics.fmean(contexts))


def _plane_cpu_s(stack: Stack) -> float:
    """The CPU seconds so far of the stack's gateway, NATS and Redis."""
    return sum(s for name, s in stack.cpu_seconds().items() if name == "gateway" or name not in stack.procs)


def fit_cpu(samples: Sequence[CpuSample], of: Callable[[CpuSample], float]) -> tuple[float, float]:
    """(seconds per request, seconds per output token) of the CPU `of` picks, by least squares over the phases;
    each clamped at 0 (a negative one is refitted as 0, the other alone)."""
    if not samples:
        return 0.0, 0.0
    a = np.array([[s.requests, s.tokens] for s in samples], dtype=float)
    y = np.array([of(s) for s in samples], dtype=float)
    (per_request, per_token), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_request < 0 or per_token < 0:  # one term alone, the one that fits better
        alone = [(float(y @ a[:, i] / (a[:, i] @ a[:, i])), i) for i in (0, 1)]
        resid = [float(np.sum((y - c * a[:, i]) ** 2)) for c, i in alone]
        (c, i) = alone[int(np.argmin(resid))]
        per_request, per_token = (max(c, 0.0), 0.0) if i == 0 else (0.0, max(c, 0.0))
    return float(per_request), float(per_token)


def stack_model_name(model_dir: str) -> str:
    """The name a stack serves a checkpoint directory under (its last path part)."""
    return Path(model_dir).name


def plane_costs(
    profile: Profile, lone: list[PlaneSample], batches: list[BatchSample], cpu: Sequence[CpuSample] = ()
) -> PlaneCosts:
    """The plane's times from probe samples, against the profile's first configuration (see the module)."""
    budget = profile.engine.max_num_batched_tokens
    costs = WorkerCosts.of(profile.configs[0], budget)
    t = profile.transfer
    # the worker's time per step outside the engine, at batch 1 (lone requests' later gaps) and B
    at_one = [gap - costs.decode.step_s(1, s.prompt + 2 + k) for s in lone for k, gap in enumerate(s.later_gaps_s)]
    xs = [1.0] + [float(b.batch) for b in batches]
    ys = [statistics.median(at_one)] + [b.gap_s - costs.decode.step_s(b.batch, b.context) for b in batches]
    points = WorkerOverhead.of(list(zip(xs, ys, strict=True))).points
    worker = WorkerOverhead(points).at(1)  # a step of one sequence
    ttft = [s.ttft_s - costs.prefill.alone_s(s.prompt, budget) - worker * -(-s.prompt // budget) for s in lone]
    pull = [t.overhead_s + s.prompt * t.bytes_per_token * t.s_per_byte for s in lone]
    gap = [s.first_gap_s - costs.decode.step_s(1, s.prompt + 1) - worker - p for s, p in zip(lone, pull, strict=True)]
    ttft_s, gap_s = statistics.median(ttft), statistics.median(gap)
    residuals = ", ".join(f"B={int(x)} {y * 1e3:.2f} ms" for x, y in zip(xs, ys, strict=True))
    plane_cpu, client_cpu = fit_cpu(cpu, lambda c: c.plane_s), fit_cpu(cpu, lambda c: c.client_s)
    phases = "; ".join(f"{c.requests} requests, {c.tokens} tokens: plane {c.plane_s:.2f} s, client {c.client_s:.2f} s"
                       for c in cpu)  # fmt: skip
    source = (f"measured on a local stack (config {profile.configs[0].config.name}, {len(lone)} lone requests, "
              f"batches {[b.batch for b in batches]}): gap - decode step {residuals}; TTFT - prefill alone "
              f"{ttft_s * 1e3:.1f} ms; first gap - decode step - worker - pull {gap_s * 1e3:.1f} ms; "
              f"CPU per phase: {phases}")  # fmt: skip
    return PlaneCosts(
        ttft_s=max(ttft_s, 0.0),
        handoff_s=max(gap_s, 0.0),
        worker=points,
        source=source,
        cpu_s_per_request=plane_cpu[0],
        cpu_s_per_token=plane_cpu[1],
        client_cpu_s_per_request=client_cpu[0],
        client_cpu_s_per_token=client_cpu[1],
    )


def measure_plane(profile: Profile, req: ProfileRequest) -> Profile:
    """The profile with its plane costs measured on a local stack."""
    lone, batches, cpu = sample_plane(profile, req)
    return msgspec.structs.replace(profile, plane=plane_costs(profile, lone, batches, cpu))
