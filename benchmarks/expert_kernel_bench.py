"""One MoE layer's routed experts on CPU: the C expert kernel against the torch paths, in one process.

    .venv/bin/python benchmarks/expert_kernel_bench.py [--threads 1,2] [--tokens 1,8,32,128] [--repeats 15]

The `small` demo's expert shapes by default (8 experts, hidden 512, intermediate 1024, top-2), random float32
weights and routing. Per token count, the three paths run alternately `--repeats` times (after a warm-up):
plain = forward_grouped_mm over the stacked weights (MKL), packed = the per-expert loop over oneDNN-packed
weights (the engine's default before the kernel), kernel = shared/model/kernels/cpu_moe.c. With several
`--threads` counts, every repeat runs each count in turn (order alternated), so the thread counts are
compared side by side too; every path uses the count torch is set to. Prints the median of each, the
kernel's speed-up, its GFLOP/s, and the largest difference from the plain path. A 2048^3 matmul's rate,
measured in the same process, says how close to this host's (loaded) matmul rate the kernel gets.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.host_info import load_average, matmul_gflops  # noqa: E402
from shared.model.kernels import cpu_moe  # noqa: E402
from shared.model.moe import Experts  # noqa: E402


def _diff(fns, threads: int) -> float:
    """Warm each path at `threads` and → the kernel's largest difference from the plain path."""
    torch.set_num_threads(threads)
    fns["packed"]()
    return (fns["kernel"]() - fns["plain"]()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts, alternated")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=2)
    args = ap.parse_args()
    thread_counts = [int(n) for n in args.threads.split(",")]
    lib = cpu_moe.load()
    if lib is None:
        sys.exit("the CPU expert kernel cannot be built or run here (see the warning)")
    e, d, i, a = args.experts, args.hidden, args.intermediate, args.top_k
    plain = Experts(e, d, i)
    with torch.no_grad():
        plain.gate_up.normal_(0, 0.05)
        plain.down.normal_(0, 0.05)
    packed, kernel = copy.deepcopy(plain), copy.deepcopy(plain)
    packed.prepack()
    assert kernel.use_cpu_kernel(lib) is None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    torch.set_num_threads(thread_counts[0])
    print(f"{cpu}, threads {args.threads}, load {load_average()[0]:.1f}, matmul {matmul_gflops():.0f} GFLOP/s"
          f" at {thread_counts[0]} thread(s)")  # fmt: skip
    print(f"experts {e} x (hidden {d}, intermediate {i}), top-{a}, float32, median of {args.repeats}")
    print("tokens threads  plain ms  packed ms  kernel ms  vs plain  vs packed  kernel GFLOP/s  max |diff|")
    gen = torch.Generator().manual_seed(0)
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, d, generator=gen)
        weights, ids = torch.randn(t, e, generator=gen).softmax(-1).topk(a, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=e)
        fns = {
            "plain": lambda c=(x, ids, weights, counts): plain.forward_grouped_mm(*c),
            "packed": lambda x=x, i=ids, w=weights, n=counts: packed.forward_grouped(x, i, w, n.tolist()),
            "kernel": lambda c=(x, ids, weights): kernel.forward_cpu_kernel(*c),
        }
        times = {(n, th): [] for th in thread_counts for n in fns}
        with torch.inference_mode():
            diff = max(_diff(fns, th) for th in thread_counts)
            for r in range(args.repeats):
                for th in thread_counts[:: 1 if r % 2 == 0 else -1]:  # alternate: drift hits all alike
                    torch.set_num_threads(th)
                    for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
                        t0 = time.perf_counter()
                        fns[name]()
                        times[name, th].append(time.perf_counter() - t0)
        flops = t * a * (2 * d * 2 * i + 2 * i * d)
        for th in thread_counts:
            ms = {n: statistics.median(times[n, th]) * 1e3 for n in fns}
            print(f"{t:6d} {th:7d} {ms['plain']:9.3f} {ms['packed']:10.3f} {ms['kernel']:10.3f}"
                  f" {ms['plain'] / ms['kernel']:8.2f}x {ms['packed'] / ms['kernel']:9.2f}x"
                  f" {flops / ms['kernel'] / 1e6:15.1f} {diff:11.2e}")  # fmt: skip
    print(f"load after {load_average()[0]:.1f}")


if __name__ == "__main__":
    main()
