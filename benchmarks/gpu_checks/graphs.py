"""Check 6: decode CUDA graphs (shared/engine/decode_graphs.py) against the eager path: the small demo model in
bfloat16 with the Triton kernels, once with graphs and once without: greedy tokens identical, and the decode
step's wall time at 1, 8 and 32 sequences both ways, with the speedup (eager ms / graph ms). --allow-cpu: the
tiny model in float32, Triton interpreted, the graphs' CPU stand-in (EagerReplay: the same static-buffer
program run again, no graph), 1/2/4 sequences, 3 steps: it proves this check's logic, not a speedup.

Both engines get the same prompts (16 random tokens each, greedy, EOS ignored) and max_model_len 2048, which
fixes the graphs' decode split count as a real deployment's would. Step times: per batch size, n requests are
prefilled in one step, then every following step (each one token per sequence, all decode-only: what the
graphs replay) is timed, the device synchronised before and after; ms per step is the median over the steps.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu_checks.common import CheckResult, Target, sync, verdict
from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.decode_graphs import EagerReplay
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams

NAME = "graphs"
PROMPT_TOKENS = 16
MAX_MODEL_LEN = 2048


def check(target: Target) -> CheckResult:
    device = target.device()
    cpu_plan, gpu_plan = ("tiny", "float32", (1, 2, 4), 3), ("small", "bfloat16", (1, 8, 32), 32)
    size, dtype, sizes, steps = cpu_plan if target.cpu else gpu_plan
    ckpt = write_demo_checkpoint(Path(target.work_dir) / f"graphs-{size}", size=size)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (max(sizes), PROMPT_TOKENS), generator=gen).tolist()
    numbers: dict = {}
    tokens: dict[bool, list[list[int]]] = {}
    step_ms: dict[bool, dict[int, float]] = {}
    for graphs in (False, True):
        engine = _engine(ckpt, dtype, device, max(sizes), graphs, target.cpu)
        greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        tokens[graphs] = engine.generate(prompts, greedy)
        step_ms[graphs] = {n: _decode_step_ms(engine, prompts[:n], steps, device) for n in sizes}
        if graphs:
            report = engine.graph_capture
            numbers |= dict(graph_steps=engine.runner.graph_steps, buckets=report.sizes if report else None,
                            capture_s=round(report.seconds, 3) if report else None,
                            graph_memory_mib=None if report is None or report.memory_bytes is None
                            else round(report.memory_bytes / 2**20, 1))  # fmt: skip
    for n in sizes:
        numbers[f"{n}_seqs"] = dict(eager_ms=round(step_ms[False][n], 3), graph_ms=round(step_ms[True][n], 3),
                                    speedup=round(step_ms[False][n] / step_ms[True][n], 3))  # fmt: skip
    same = [a == b for a, b in zip(tokens[False], tokens[True], strict=True)]
    numbers["tokens_equal"] = sum(same) / len(same)
    numbers["min_leading_equal"] = min(_leading_equal(a, b) for a, b in zip(tokens[False], tokens[True], strict=True))
    failures = []
    if not all(same):
        failures.append(f"tokens differ with graphs in {len(same) - sum(same)} of {len(same)} prompts")
    if not numbers.get("graph_steps"):
        failures.append("no step replayed a graph")
    backend = "EagerReplay (CPU stand-in, not a graph)" if target.cpu else "CUDA graphs"
    details = (f"{size} demo model, {dtype}, kernels=triton, {backend}, {len(prompts)} prompts x {steps} greedy "
               f"tokens; step ms: median decode step per batch size, {device}; speedup = eager / graphs")  # fmt: skip
    return verdict(NAME, failures, numbers, details)


def _leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens two generations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _engine(ckpt: Path, dtype: str, device: str, seqs: int, graphs: bool, cpu: bool) -> Engine:
    blocks = seqs * (-(-(PROMPT_TOKENS + 64) // 16) + 1) + MAX_MODEL_LEN // 16
    scheduler = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * PROMPT_TOKENS)
    return Engine.from_dir(ckpt, graph_backend=EagerReplay() if cpu and graphs else None, cuda_graphs=graphs,
                           kernels="triton", dtype=dtype, device=device, num_kv_blocks=blocks,
                           max_model_len=MAX_MODEL_LEN, scheduler=scheduler)  # fmt: skip


def _decode_step_ms(engine: Engine, prompts: list[list[int]], steps: int, device: str) -> float:
    """Median wall time of the decode-only steps of one batch of len(prompts) requests, in ms."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"step-{len(prompts)}-{i}", prompt, params)
    engine.step()  # the prefill of every prompt (their first tokens)
    times = []
    while engine.has_unfinished():
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
