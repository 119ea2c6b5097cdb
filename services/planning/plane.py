"""`pdserve profile --serving-plane`: what the serving plane adds to the engines' time, measured on a local stack
(private NATS and Redis, the gateway, one prefill and one decode worker of the profile's first configuration,
pinned to disjoint cores when there are enough; prefix caching off, every prompt remote).

Unloaded requests, one at a time, through the OpenAI API (the bench client, services/bench):
- plane TTFT = the median of (TTFT - the prompt's prefill alone on the profile, costs.PrefillCost.alone_s, and the
  plane step of each of its steps): HTTP, the gateway, the job's publish and fetch, the token event's way back;
- plane step = the median of (the later inter-token gaps - one decode step at batch 1 and their context): the
  decode worker's own time per step outside the engine (its loop: outputs handed over, token events published);
- plane hand-off = the median of (the first inter-token gap - one decode step - plane step - the pull's modelled
  cost): the decode job's publish and fetch, the Redis lookup, the import, what the pull costs beyond the model.
All are clamped at 0; the profile keeps the raw medians in its `plane.source` text.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from services.bench.datasets import BenchRequest
from services.bench.prompts import PromptMaker
from services.bench.runner import BenchConfig, run
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from services.planning.costs import WorkerCosts
from services.planning.profile import ProfileRequest
from services.planning.profile_file import PlaneCosts, Profile
from shared.model.tokenizer import Tokenizer

PROBE_OUTPUT = 16  # tokens: the first gap is the hand-off's, the later ones decode steps of one sequence
WARMUPS = 2


@dataclass(frozen=True)
class PlaneSample:
    prompt: int
    ttft_s: float
    first_gap_s: float
    later_gaps_s: tuple[float, ...]  # the gaps after the first: decode steps of one sequence


def _spec(profile: Profile, req: ProfileRequest) -> StackSpec:
    config = profile.configs[0].config
    cpus = sorted(os.sched_getaffinity(0))
    units = config.units
    pinned = (
        {"prefill": tuple(cpus[:units]), "decode": tuple(cpus[units : 2 * units])} if 2 * units <= len(cpus) else {}
    )
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


def sample_plane(profile: Profile, req: ProfileRequest, lengths: tuple[int, ...] = (32, 128), repeats: int = 3):
    """Unloaded requests of each prompt length, `repeats` each, after warm-ups: → PlaneSamples."""
    stack = Stack(_spec(profile, req))
    stack.start(ready_timeout_s=300)
    try:
        tok = Tokenizer(req.model)
        maker, rng = PromptMaker(tok), np.random.default_rng(req.seed)
        config = BenchConfig(base_url=stack.url, model=stack_model_name(req.model), progress=False, timeout_s=120)
        samples = []
        for i, length in enumerate([lengths[0]] * WARMUPS + [n for n in lengths for _ in range(repeats)]):
            text, real = maker.make(length, rng)
            rec = run(config, [BenchRequest(text, real, PROBE_OUTPUT)]).records[0]
            if not rec.success:
                raise RuntimeError(f"a serving-plane probe failed: {rec.error}\n{stack.logs()}")
            if i >= WARMUPS:
                samples.append(PlaneSample(rec.prompt_len, rec.ttft_s, rec.itl_s[0], tuple(rec.itl_s[1:])))
        return samples
    finally:
        stack.stop()


def stack_model_name(model_dir: str) -> str:
    """The name a stack serves a checkpoint directory under (its last path part)."""
    return Path(model_dir).name


def plane_costs(profile: Profile, samples: list[PlaneSample]) -> PlaneCosts:
    """The plane's two times from probe samples, against the profile's first configuration (see the module)."""
    budget = profile.engine.max_num_batched_tokens
    costs = WorkerCosts.of(profile.configs[0], budget)
    t = profile.transfer
    step = [gap - costs.decode.step_s(1, s.prompt + 2 + k) for s in samples for k, gap in enumerate(s.later_gaps_s)]
    step_s = max(statistics.median(step), 0.0)
    # the simulation adds the plane's step to each of a prompt's prefill steps too
    ttft = [s.ttft_s - costs.prefill.alone_s(s.prompt, budget) - step_s * -(-s.prompt // budget) for s in samples]
    pull = [t.overhead_s + s.prompt * t.bytes_per_token * t.s_per_byte for s in samples]
    gap = [
        s.first_gap_s - costs.decode.step_s(1, s.prompt + 1) - step_s - p for s, p in zip(samples, pull, strict=True)
    ]
    ttft_s, gap_s = statistics.median(ttft), statistics.median(gap)
    source = (f"measured on a local stack ({len(samples)} unloaded requests, config {profile.configs[0].config.name}):"
              f" TTFT - prefill alone {ttft_s * 1e3:.1f} ms, later gaps - decode step {step_s * 1e3:.2f} ms, first "
              f"gap - decode step - plane step - pull {gap_s * 1e3:.1f} ms (medians; clamped at 0)")  # fmt: skip
    return PlaneCosts(max(ttft_s, 0.0), max(gap_s, 0.0), step_s, source)


def measure_plane(profile: Profile, req: ProfileRequest) -> Profile:
    """The profile with its plane costs measured on a local stack."""
    return msgspec.structs.replace(profile, plane=plane_costs(profile, sample_plane(profile, req)))
