"""Where a decode step's time goes: torch.profiler over decode steps of the engine, CPU.

    .venv/bin/python benchmarks/profile_decode.py [--batch 32] [--steps 10] [--threads N] [--no-prepack] [--phases]
        [--dtype float32|bfloat16|int8]

B requests of PROMPT tokens are prefilled, a few decode steps warm up, then `--steps` decode steps run under
torch.profiler. Prints the ops by self CPU time, the profiled steps' median wall time, the aten op calls a
step, and the share of the step spent outside any aten op (the C kernels, Python, metadata building).
`--no-prepack` runs the plain (MKL) matmul weights: the situation of a host where oneDNN's packed weights gain
nothing (see docs/benchmarks.md).
`--phases` times the same steps again without the profiler, per phase (metadata build, embedding, attention
and MoE summed over the layers, final norm + logits, sampling; the rest is the engine's Python around them):
wall-clock stamps at module boundaries, exact on CPU, where every op runs synchronously.
`--dtype` serves the weights as engine_bench.py's --dtype does (bfloat16; int8: float32 with load-time int8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine import step_inputs  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.transformer import DecoderLayer  # noqa: E402

PROMPT = 128
# op classes of the breakdown: the first class whose any substring is in the op's name takes it
OP_CLASSES = (
    ("matmuls", ("linear", "mm", "addmm", "matmul", "bmm")),
    ("attention (SDPA)", ("scaled_dot_product", "_softmax")),
    ("indexing (KV gather/write, routing)", ("index", "scatter", "gather", "sort", "topk", "take")),
    ("copies, allocation, views", ("copy", "empty", "cat", "stack", "view", "slice", "narrow", "strided", "chunk",
                                   "split", "select", "reshape", "transpose", "unsqueeze", "flatten", "fill", "zero",
                                   "pad", "clone", "contiguous", "to", "detach", "alias", "expand")),
    ("elementwise (norms, rope, silu, residual)", ("",)),
)  # fmt: skip


def op_class(name: str) -> str:
    short = name.split("::")[-1]
    return next(label for label, keys in OP_CLASSES if any(k in short for k in keys))


class PhaseClock:
    """Seconds per phase of the steps run while `on`: forward hooks on the model's modules and wrappers around
    the metadata builder and the sampler, each adding its own wall time to its phase."""

    def __init__(self, engine: Engine) -> None:
        self.seconds: dict[str, float] = {}
        self.on = False
        model = engine.model
        for name, module in (("embedding", model.model.embed_tokens), ("final norm", model.model.norm)):
            self._hook(name, module)
        attention, moe = "attention (norm, qkv, rope, KV write, attend, o_proj)", "MoE (norm, router, experts)"
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            self._hook(attention, layer.self_attn)
            self._hook(attention, layer.input_layernorm)
            self._hook(moe, layer.mlp)
            self._hook(moe, layer.post_attention_layernorm)
        build = step_inputs.AttentionMetadata.build
        step_inputs.AttentionMetadata.build = self._timed("metadata build", build)  # type: ignore[method-assign]
        model.logits = self._timed("logits", model.logits)  # type: ignore[method-assign]
        sampler = engine.runner.sampler
        sampler.sample_with_logprobs = self._timed("sampling", sampler.sample_with_logprobs)  # type: ignore[method-assign]

    def _add(self, phase: str, seconds: float) -> None:
        if self.on:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def _hook(self, phase: str, module: torch.nn.Module) -> None:
        start: list[float] = []
        module.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))
        module.register_forward_hook(lambda *_: self._add(phase, time.perf_counter() - start.pop()))

    def _timed(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(phase, time.perf_counter() - t0)

        return timed


def print_phases(engine: Engine, steps: int) -> None:
    clock = PhaseClock(engine)
    clock.on = True
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    clock.on = False
    print(f"\nper phase, ms per step (mean of {steps} steps, no profiler; step {step_ms:.2f} ms):")
    rest = step_ms
    for phase, s in clock.seconds.items():
        ms = 1000 * s / steps
        rest -= ms
        print(f"  {phase:56s} {ms:8.2f}  {100 * ms / step_ms:5.1f}%")
    print(f"  {'the rest (scheduler, runner, step inputs, Python)':56s} {rest:8.2f}  {100 * rest / step_ms:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-prepack", action="store_true", help="plain matmul weights (no oneDNN packing)")
    ap.add_argument("--rows", type=int, default=25, help="ops listed")
    ap.add_argument("--phases", action="store_true", help="then time the same number of steps per phase")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="float32", help="weight format")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")
    engine = Engine.from_dir(
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.batch * PROMPT, max_num_seqs=args.batch),
        num_kv_blocks=args.batch * (-(-(PROMPT + 2 * args.steps + 16) // 16)),
        max_model_len=PROMPT + (2 if args.phases else 1) * args.steps + 16,
        prepack_weights=not args.no_prepack,
        dtype="float32" if args.dtype == "int8" else args.dtype,
        quantization="int8" if args.dtype == "int8" else None,
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2 * args.steps + 12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(0, engine.model.config.vocab_size, (args.batch, PROMPT), generator=gen)):
        engine.add_request(f"p{i}", prompt.tolist(), params)
    for _ in range(8):  # the prefill, then warm-up decode steps
        engine.step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    events = prof.key_averages()
    op_us = sum(e.self_cpu_time_total for e in events) / args.steps
    calls = sum(e.count for e in events) / args.steps  # ops dispatched per step, nested ones included
    step_ms = 1000 * statistics.median(walls)
    print(f"\n{args.batch} sequences, {args.dtype}, {args.threads} threads, "
          f"prepack {'off' if args.no_prepack else 'on'}, {torch.__version__}: "
          f"median step {step_ms:.2f} ms (under the profiler), "
          f"ops {op_us / 1000:.2f} ms/step, {calls:.0f} op calls/step")  # fmt: skip
    by_class: dict[str, float] = {}
    for e in events:
        by_class[op_class(e.key)] = by_class.get(op_class(e.key), 0.0) + e.self_cpu_time_total / args.steps / 1000
    # the C kernels (ctypes calls: experts, attention, norms, panel linears) are no aten ops: they count here
    by_class["outside aten ops (C kernels, Python, metadata)"] = max(0.0, step_ms - op_us / 1000)
    print("\nper op class, ms per step (self time):")
    for label, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  {label:48s} {ms:8.2f}  {100 * ms / step_ms:5.1f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
    if args.phases:
        print_phases(engine, args.steps)


if __name__ == "__main__":
    main()
