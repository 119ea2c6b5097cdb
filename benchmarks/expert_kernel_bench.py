"""One MoE layer's routed experts on CPU: the C expert kernel's builds against the torch paths, in one process.

    .venv/bin/python benchmarks/expert_kernel_bench.py [--threads 1,2] [--tokens 1,8,32,128] [--repeats 15]
        [--isa avx512,avx2] [--variant NAME=FLAGS ...] [--no-torch] [--dtype float32,bfloat16,int8]
        [--out FILE.json]

The `small` demo's expert shapes by default (8 experts, hidden 512, intermediate 1024, top-2), random float32
weights and routing. Per token count, the paths run alternately `--repeats` times (after a warm-up): plain =
forward_grouped_mm over the stacked weights (MKL), packed = the per-expert loop over oneDNN-packed weights (the
engine's default before the kernel), then one path per kernel build (`--isa`, default every build this CPU
runs) and per `--variant` (the first `--isa` built with extra gcc flags, e.g. pf0=-DPDSERVE_PREFETCH=0). With
several `--threads` counts, every repeat runs each count in turn (order alternated), so the thread counts are
compared side by side too; every path uses the count torch is set to. Prints the median of each, every kernel
path's speed-up over plain and over the first kernel path, its GFLOP/s, and whether all kernel paths gave the
same bits. A 2048^3 matmul's rate, measured in the same process, says how close to this host's (loaded) matmul
rate the kernel gets; the host's read bandwidth gives each case's memory floor (its weights read once).

--dtype adds each kernel path once more per further weight format, named `<path>@<format>`: bfloat16 (bfloat16
activations and weights, from the same float32 weights rounded) and int8 (load-time weight-only int8 of them,
float32 activations; shared/model/int8.py). Their `x floor` is over their own bytes (2 and 1 a weight, scales
left out); `same bits` is checked among the paths of one format.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.host_info import cpu_info, load_average, matmul_gflops, read_bandwidth  # noqa: E402
from shared.model import int8  # noqa: E402
from shared.model.experts import Experts  # noqa: E402
from shared.model.kernels import cpu_moe  # noqa: E402

WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
WEIGHTS_SEPARATOR = "@"  # a kernel path in another weight format: <path>@<format>


def _format(path: str) -> str:
    return path.partition(WEIGHTS_SEPARATOR)[2] or "float32"


def _kernel_paths(isas: list[str], variants: list[str]) -> dict[str, cpu_moe.Kernel]:
    paths = {}
    for isa in isas:
        kernel = cpu_moe.load_build(isa)
        if kernel is None:
            sys.exit(f"this CPU cannot run the {isa} build of the kernel")
        paths[f"kernel-{isa}"] = kernel
    for spec in variants:
        name, _, flags = spec.partition("=")
        kernel = cpu_moe.load_build(isas[0], tuple(flags.split()))
        assert kernel is not None
        paths[f"kernel-{name}"] = kernel
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts, alternated")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--isa", default=None, help="comma-separated builds (default: every one this CPU runs)")
    ap.add_argument("--variant", action="append", default=[], help="NAME=FLAGS: the first --isa with gcc FLAGS")
    ap.add_argument("--no-torch", action="store_true", help="kernel paths only (plain is still the reference)")
    ap.add_argument("--dtype", default="float32", help="comma-separated weight formats: float32, bfloat16, int8")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    formats = args.dtype.split(",")
    if unknown := set(formats) - set(WEIGHT_BYTES):
        ap.error(f"--dtype: unknown format(s) {', '.join(sorted(unknown))}")
    thread_counts = [int(n) for n in args.threads.split(",")]
    isas = args.isa.split(",") if args.isa else [k.isa for k in cpu_moe.kernels()]
    if not isas:
        sys.exit("the CPU expert kernel cannot be built or run here (see the warning)")
    kernels = _kernel_paths(isas, args.variant)
    e, d, i, a = args.experts, args.hidden, args.intermediate, args.top_k
    plain = Experts(e, d, i)
    with torch.no_grad():
        plain.gate_up.normal_(0, 0.05)
        plain.down.normal_(0, 0.05)
    packed = copy.deepcopy(plain)
    packed.prepack()
    panels = {name: k.pack(plain.gate_up.data, plain.down.data) for name, k in kernels.items()}
    quantized = int8.quantize(plain.gate_up), int8.quantize(plain.down)
    bf16 = plain.gate_up.data.bfloat16(), plain.down.data.bfloat16()
    for fmt in formats[1:] if formats[0] == "float32" else formats:
        for name, k in list(kernels.items()):
            if WEIGHTS_SEPARATOR in name:
                continue
            path = f"{name}{WEIGHTS_SEPARATOR}{fmt}"
            kernels[path] = k
            panels[path] = k.pack_int8(*quantized) if fmt == "int8" else k.pack(*bf16 if fmt == "bfloat16" else ())
    if formats[0] != "float32":  # the float32 paths only as the reference: drop them
        kernels = {n: k for n, k in kernels.items() if WEIGHTS_SEPARATOR in n}
    host = {**cpu_info(), "read_gbps": read_bandwidth()}
    torch.set_num_threads(thread_counts[0])
    gflops = matmul_gflops()
    print(f"{host['cpu']}, threads {args.threads}, load {load_average()[0]:.1f}, matmul {gflops:.0f} GFLOP/s"
          f" at {thread_counts[0]} thread(s), read {host['read_gbps']:.1f} GB/s")  # fmt: skip
    print(f"experts {e} x (hidden {d}, intermediate {i}), top-{a}, {', '.join(formats)}, median of {args.repeats}")
    first = next(iter(kernels))
    rows = []
    gen = torch.Generator().manual_seed(0)
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, d, generator=gen)
        weights, ids = torch.randn(t, e, generator=gen).softmax(-1).topk(a, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=e)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "plain": lambda c=(x, ids, weights, counts): plain.forward_grouped_mm(*c)
        }
        if not args.no_torch:
            fns["packed"] = lambda x=x, i=ids, w=weights, n=counts: packed.forward_grouped(x, i, w, n.tolist())
        xb = x.bfloat16()
        for name, k in kernels.items():
            xs = xb if _format(name) == "bfloat16" else x
            fns[name] = lambda k=k, p=panels[name], c=(xs, ids, weights): k.moe(*c, p)
        times = {(n, th): [] for th in thread_counts for n in fns}
        with torch.inference_mode():
            outs = {}
            for th in thread_counts:  # warm every path at every count; keep the outputs of the first
                torch.set_num_threads(th)
                for name, fn in fns.items():
                    outs.setdefault(name, fn())
            same_bits = all(torch.equal(outs[n], outs[m]) for n in kernels for m in kernels if _format(n) == _format(m))
            diff = (outs[first].float() - outs["plain"]).abs().max().item()
            diffs = {n: (outs[n].float() - outs["plain"]).abs().max().item() for n in kernels}
            for r in range(args.repeats):
                for th in thread_counts[:: 1 if r % 2 == 0 else -1]:  # alternate: drift hits all alike
                    torch.set_num_threads(th)
                    for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
                        t0 = time.perf_counter()
                        fns[name]()
                        times[name, th].append(time.perf_counter() - t0)
        flops = t * a * (2 * d * 2 * i + 2 * i * d)
        active = int((counts > 0).sum())
        floor_ms = active * 3 * d * i * 4 / (host["read_gbps"] * 1e9) * 1e3  # the active experts' weights, once
        for th in thread_counts:
            ms = {n: statistics.median(times[n, th]) * 1e3 for n in fns}
            rows.append({"tokens": t, "threads": th, "ms": ms, "floor_ms": floor_ms, "same_bits": same_bits,
                         "max_abs_diff_vs_plain": diff, "max_abs_diff_vs_plain_by_path": diffs})  # fmt: skip
            print(
                f"\ntokens {t}, threads {th}: memory floor {floor_ms:.3f} ms ({active} experts' weights),"
                f" kernel paths bitwise equal: {'yes' if same_bits else 'NO'}, |{first} - plain| {diff:.2e}"
            )
            print(f"  {'path':30s} {'ms':>8s} {'vs plain':>9s} {'vs ' + first:>18s} {'GFLOP/s':>8s} {'x floor':>8s}")
            for name, v in ms.items():
                own_floor = floor_ms * WEIGHT_BYTES[_format(name)] / 4
                print(f"  {name:30s} {v:8.3f} {ms['plain'] / v:8.2f}x {ms[first] / v:17.2f}x"
                      f" {flops / v / 1e6:8.1f} {v / own_floor:8.2f}")  # fmt: skip
    print(f"\nload after {load_average()[0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps({"host": host, "matmul_gflops": gflops, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
