"""`pdserve profile`: measure, on this host, what each given worker configuration costs, and write a profile file
(profile_file.py) for `pdserve plan`.

Per configuration the engine is the one a worker of that shape runs (EngineConfig's defaults, as a worker's
settings give them, but for prefix caching, off: the measurements repeat their prompts), built the way the
worker builds it: one process, or with tp/ep > 1 a worker group led by this process (`start_group`: real ranks
over gloo, each pinned to its share of the configuration's cores). This process is pinned to the configuration's
first `units` cores while it is measured.

- prefill: one prompt of each length alone (random tokens, greedy, max_tokens 1), timed from its arrival in the
  engine to its first token, over however many steps the chunk budget cuts it into; the median of `repeats`
  after one warm-up.
- decode: for each context C, one prompt of C tokens is computed once and its KV exported; for each batch size B
  that KV is imported B times (Engine.import_kv: B sequences, each with blocks of its own, as a decode worker
  holds handed-off requests), a few steps warm up, then `decode_steps` decode-only steps are timed one by one: the
  median step, at the mean context of the timed steps. No prompt is computed per batch, so a large grid stays cheap.
  The copies sample at temperature 1, each with a seed of its own, so that from the first step on each feeds
  its own tokens: B greedy copies would feed one token B times, route every row to the same experts and time an
  MoE step that reads only top_k experts' weights, where B real requests read up to all of them (it made the
  small demo's decode step at 16 sequences 2-3x cheaper than a decode worker's).

The KV hand-off's coefficients are not measured here: the profile carries the prefill path's cost model defaults
(services/gateway/path_signals.py), which a flag overrides. The serving plane's own time (HTTP, NATS hops) is not
measured here: `--plane-*-ms` record it when known, `--serving-plane` measures it on a local stack (plane.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from services.gateway.path_signals import DEFAULT_KV_PULL_OVERHEAD_MS, DEFAULT_KV_TRANSFER_MS_PER_MB
from services.planning.profile_file import (
    FORMAT,
    ConfigProfile,
    DecodePoint,
    EngineLimits,
    Host,
    ModelFacts,
    PlaneCosts,
    PrefillPoint,
    Profile,
    TransferCosts,
    WorkerConfig,
)
from shared.engine.config import Dtype, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams

WARMUP_DECODE_STEPS = 2


@dataclass(frozen=True)
class Grid:
    """What is measured per configuration."""

    prompt_lens: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_steps: int = 16  # timed decode steps per (batch, context)
    repeats: int = 3  # prefill runs per length (the median counts)


FULL = Grid((32, 128, 256, 512, 1024, 2048), (1, 2, 4, 8, 16, 32, 64), (128, 512, 2048))
QUICK = Grid((16, 64, 256), (1, 4, 16), (32, 256), decode_steps=6, repeats=1)


@dataclass(frozen=True)
class ProfileRequest:
    model: str
    configs: tuple[WorkerConfig, ...]
    grid: Grid
    dtype: Dtype | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_cache_bytes: int | None = None
    transfer_ms_per_mb: float = DEFAULT_KV_TRANSFER_MS_PER_MB
    pull_overhead_ms: float = DEFAULT_KV_PULL_OVERHEAD_MS
    plane_ttft_ms: float = 0.0
    plane_handoff_ms: float = 0.0
    plane_step_ms: float = 0.0
    plane_token_ms: float = 0.0
    seed: int = 0


def run_profile(req: ProfileRequest, log=print) -> Profile:
    """Measure every configuration of `req` in turn; → the profile (not yet written)."""
    load = os.getloadavg()
    measured: list[ConfigProfile] = []
    facts: list[tuple[int, ModelFacts]] = []  # (ranks, facts) per config: a single rank's are the whole model's
    limits: EngineLimits | None = None
    cpus = sorted(os.sched_getaffinity(0))
    for config in req.configs:
        if config.units > len(cpus):
            raise ValueError(f"config {config.name} needs {config.units} cores; this process may use {len(cpus)}")
        log(f"profiling config {config.name} ({config.units} cores, TP {config.tp}, EP {config.ep}) ...")
        t0 = time.perf_counter()
        with _pinned(cpus[: config.units]), profiled_engine(req, config) as engine:
            facts.append((config.ranks, _model_facts(req, engine, config)))
            limits = limits or _limits(engine)
            prefill = measure_prefill(engine, req.grid, req.seed)
            decode = measure_decode(engine, req.grid, req.seed)
            kv_tokens = engine.blocks.num_blocks * engine.config.block_size
        measured.append(ConfigProfile(config, prefill, decode, kv_tokens, round(time.perf_counter() - t0, 2)))
        log(f"  prefill {_prefill_line(prefill)}; decode {_decode_line(decode)} ({measured[-1].seconds:.0f} s)")
    assert limits is not None
    model = min(facts, key=lambda f: f[0])[1]
    return Profile(
        format=FORMAT,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        host=_host(req, load),
        model=model,
        engine=limits,
        transfer=TransferCosts(
            overhead_s=req.pull_overhead_ms / 1e3,
            s_per_byte=req.transfer_ms_per_mb / 1e3 / 1e6,
            bytes_per_token=model.kv_bytes_per_token,
            source="the prefill path's cost model (services/gateway/path_signals.py) unless --transfer-* set",
        ),
        plane=PlaneCosts(
            ttft_s=req.plane_ttft_ms / 1e3,
            handoff_s=req.plane_handoff_ms / 1e3,
            worker=_worker_line(req.plane_step_ms / 1e3, req.plane_token_ms / 1e3),
            source="--plane-ttft-ms / --plane-handoff-ms / --plane-step-ms / --plane-token-ms",
        ),
        configs=tuple(measured),
        grid={
            "prompt_lens": list(req.grid.prompt_lens),
            "batches": list(req.grid.batches),
            "contexts": list(req.grid.contexts),
        },  # fmt: skip
    )


def _worker_line(step_s: float, token_s: float) -> tuple[tuple[float, float], ...]:
    """A worker's time outside the engine as step_s + token_s per output (PlaneCosts.worker points); () for none."""
    return ((1.0, step_s + token_s), (2.0, step_s + 2 * token_s)) if step_s or token_s else ()


@contextmanager
def _pinned(cpus: list[int]) -> Iterator[None]:
    """This process (and the ranks it spawns, which split these cores) on `cpus` while inside."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def profiled_engine(req: ProfileRequest, config: WorkerConfig) -> Iterator[Engine]:
    """The engine of a worker of this configuration (a group's leader for tp/ep > 1), closed after."""
    engine_config = EngineConfig(
        model=req.model,
        dtype=req.dtype,
        threads=config.units,  # a group's ranks split them (group_engine.rank_placements)
        tp=config.tp,
        ep=config.ep,
        kv_cache_bytes=req.kv_cache_bytes,
        enable_prefix_caching=False,
        scheduler=req.scheduler,
    )
    if config.ranks == 1:
        yield Engine.build(engine_config)
        return
    from shared.parallel.group_engine import start_group

    group = start_group(engine_config)
    try:
        yield group.engine
    finally:
        group.close()


def random_prompt(gen: torch.Generator, length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _prefill_once(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, steps) of one prompt alone."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def measure_prefill(engine: Engine, grid: Grid, seed: int = 0) -> tuple[PrefillPoint, ...]:
    """Each prompt length of the grid that fits the model, alone: the median of grid.repeats after a warm-up."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    points = []
    for length in (n for n in grid.prompt_lens if n < engine.max_model_len):
        prompt = random_prompt(gen, length, vocab)
        _prefill_once(engine, f"warm-{length}", prompt)
        runs = [_prefill_once(engine, f"prefill-{length}-{r}", prompt) for r in range(grid.repeats)]
        points.append(PrefillPoint(length, statistics.median(s for s, _ in runs), runs[0][1]))
    return tuple(points)


def measure_decode(engine: Engine, grid: Grid, seed: int = 0) -> tuple[DecodePoint, ...]:
    """Decode steps over the grid's (batch, context) cells that fit the pool and the model's length."""
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = engine.model.config.vocab_size
    steps = WARMUP_DECODE_STEPS + grid.decode_steps
    capacity = engine.blocks.num_blocks * engine.config.block_size
    points = []
    for context in grid.contexts:
        if context + steps + 1 > engine.max_model_len:
            continue
        prompt = random_prompt(gen, context, vocab)
        engine.add_request("source", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                           hold_kv=True)  # fmt: skip
        first: list[int] = []
        while engine.has_unfinished():
            first += [t for out in engine.step() for t in out.new_token_ids]
        kv = engine.export_kv("source")
        engine.release_kv("source")
        for batch in grid.batches:
            per_seq = -(-(context + steps + 1) // engine.config.block_size) * engine.config.block_size
            if batch * per_seq > 0.9 * capacity or batch > engine.config.scheduler.max_num_seqs:
                continue
            step_s = _decode_steps(engine, prompt, first, kv, batch, steps)
            points.append(DecodePoint(batch, context + 1 + WARMUP_DECODE_STEPS + grid.decode_steps / 2, step_s))
    return tuple(points)


def _decode_steps(engine: Engine, prompt: list[int], first: list[int], kv, batch: int, steps: int) -> float:
    """`batch` copies of an imported request, decoded `steps` steps: the median of the timed (non-warm-up) ones. Each
    copy samples its own tokens (seeded, temperature 1: see the module), so the batch routes as distinct requests."""
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        params = SamplingParams(max_tokens=1 + steps, temperature=1.0, seed=i, ignore_eos=True)
        engine.import_kv(rid, prompt, first, params, kv)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    timed = times[WARMUP_DECODE_STEPS:]
    if len(timed) < 1:
        raise RuntimeError(f"batch {batch}: the decode ran {len(times)} steps, fewer than its warm-up")
    return statistics.median(timed)


def _model_facts(req: ProfileRequest, engine: Engine, config: WorkerConfig) -> ModelFacts:
    cfg_path = Path(req.model) / "config.json"
    canonical = json.dumps(json.loads(cfg_path.read_text()), sort_keys=True, separators=(",", ":"))
    model = engine.model
    # a group leader's pool holds its share of the KV heads; the hand-off moves every rank's share
    per_token = engine.layout.bytes_per_token * (config.tp if config.tp > 1 else 1)
    return ModelFacts(
        path=str(req.model),
        model_type=model.config.model_type,
        fingerprint="sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16],
        params=sum(p.numel() for p in model.parameters()),  # a group leader's: its shard
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        kv_bytes_per_token=per_token,
    )


def _limits(engine: Engine) -> EngineLimits:
    s = engine.config.scheduler
    return EngineLimits(s.max_num_seqs, s.max_num_batched_tokens, engine.config.block_size, engine.max_model_len,
                        s.enable_chunked_prefill)  # fmt: skip


def _host(req: ProfileRequest, load: tuple[float, float, float]) -> Host:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return Host(cpu=cpu, cores=len(os.sched_getaffinity(0)), device="cpu", torch=str(torch.__version__),
                python=sys.version.split()[0], load_average=load)  # fmt: skip


def _prefill_line(points: tuple[PrefillPoint, ...]) -> str:
    return ", ".join(f"{p.tokens} tok {1e3 * p.seconds:.1f} ms" for p in points)


def _decode_line(points: tuple[DecodePoint, ...]) -> str:
    return ", ".join(f"B{p.batch}@{p.context:.0f} {1e3 * p.step_s:.2f} ms" for p in points)
