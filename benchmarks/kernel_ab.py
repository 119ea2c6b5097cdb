"""One CPU kernel on and off inside one engine, swapped every other decode step: what it buys a step, CPU.

    .venv/bin/python benchmarks/kernel_ab.py [--kernel norm|attention] [--batch 32] [--steps 100] [--threads 2]

B requests of 128 random tokens on the `small` demo model are prefilled, a few decode steps warm up, then
`--steps` decode steps run with the kernel set on even steps and off on odd ones (the torch ops it replaces),
so both halves see the same host, the same contexts (growing together) and the same noise. Prints the median
step of each half, their difference, the CPU model and the load average. Kernels:
- norm: every RMSNorm (with its residual add) and the q/k norm + RoPE (shared/model/kernels/cpu_norm_rope.c);
- attention: the decode attention (shared/model/kernels/cpu_attention.c) against the torch buckets.
Within one step the outputs of the two paths differ in the last bits only; the sampled tokens are not compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.host_info import cpu_info, load_average  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.attention import Attention  # noqa: E402
from shared.model.kernels import cpu_norm_rope  # noqa: E402
from shared.model.layers import RMSNorm  # noqa: E402

PROMPT = 128


def switch(engine: Engine, kernel: str):
    """→ set(on): puts `kernel` in or out of the engine's model between steps."""
    model = engine.model
    if kernel == "attention":
        if not model.cpu_attention:
            sys.exit("the CPU attention kernel is not in use on this host (see the engine's log)")

        def set_attention(on: bool) -> None:
            model.cpu_attention = on  # read by each step's metadata build

        return set_attention
    lib = cpu_norm_rope.load()
    if lib is None:
        sys.exit("the CPU norm kernel cannot be built here")
    modules = list(model.modules())

    def set_norm(on: bool) -> None:
        for m in modules:
            if isinstance(m, RMSNorm):
                m.kernel = lib if on else None
            elif isinstance(m, Attention):
                m.rope_kernel = lib if on else None

    return set_norm


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kernel", choices=("norm", "attention"), default="norm")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")
    tokens = args.steps + 16
    engine = Engine.from_dir(
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.batch * PROMPT, max_num_seqs=args.batch),
        num_kv_blocks=args.batch * -(-(PROMPT + tokens + 1) // 16),
        max_model_len=PROMPT + tokens + 1,
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(0, engine.model.config.vocab_size, (args.batch, PROMPT), generator=gen)):
        engine.add_request(f"ab{i}", prompt.tolist(), params)
    set_kernel = switch(engine, args.kernel)
    load_before = load_average()
    for _ in range(5):  # the prefill, then warm-up decode steps on both paths
        engine.step()
        set_kernel(False)
        engine.step()
        set_kernel(True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps):
        on = step % 2 == 0
        set_kernel(on)
        t0 = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - t0)
    on_ms, off_ms = (1000 * statistics.median(times[k]) for k in (True, False))
    cpu = cpu_info()
    print(f"{cpu['cpu']}, {args.threads} threads, load average {load_before[0]:.1f} -> {load_average()[0]:.1f}")
    print(f"{args.kernel} kernel, {args.batch} sequences, {args.steps} steps alternated (contexts {PROMPT + 6}-"
          f"{PROMPT + 6 + args.steps}): median step {on_ms:.2f} ms on, {off_ms:.2f} ms off, "
          f"{off_ms - on_ms:+.2f} ms saved ({off_ms / on_ms:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
