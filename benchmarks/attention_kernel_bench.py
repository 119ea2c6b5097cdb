"""One layer's decode attention on CPU: the C attention kernel against the torch bucket path, in one process.

    .venv/bin/python benchmarks/attention_kernel_bench.py [--threads 2] [--repeats 51]

The `small` demo's attention shapes (8 query heads, 2 KV heads, head dim 64, 16-token blocks, float32) over a
scattered block pool, for a uniform batch (32 x 144 context) and a mixed one (31 x 128 + 1 x 4096). Each
repeat runs both paths of both batches (order alternated): paged_attention with the metadata of each layout,
including the K/V write they share. Prints the medians per layer call, x 8 for the demo's 8 layers, and the
largest difference between the paths. The metadata is built once per batch, as the engine does per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.host_info import load_average  # noqa: E402
from shared.model.kernels import cpu_attention  # noqa: E402
from shared.model.paged_attention import AttentionMetadata, paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 8, 2, 64, 16, 8
BATCHES = {"uniform 32 x 144": [144] * 32, "mixed 31 x 128 + 4096": [128] * 31 + [4096]}


def _case(lens: list[int], gen: torch.Generator):
    need = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(sum(need), generator=gen).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at : at + nb])
        at += nb
    cache = torch.randn(2, sum(need), BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, len(lens), KV_HEADS, HEAD_DIM, generator=gen)
    metas = {
        name: AttentionMetadata.build(tables, lens, [1] * len(lens), BLOCK, cpu_decode_kernel=kernel)
        for name, kernel in (("kernel", True), ("torch", False))
    }
    return {name: (lambda m=m: paged_attention(q, k, v, cache, m, HEAD_DIM**-0.5)) for name, m in metas.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="CPU decode attention: the C kernel against the torch buckets")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=51)
    args = ap.parse_args()
    if cpu_attention.load() is None:
        raise SystemExit("the CPU attention kernel cannot be built or run here")
    torch.set_num_threads(args.threads)
    load_before = load_average()
    gen = torch.Generator().manual_seed(0)
    cases = {batch: _case(lens, gen) for batch, lens in BATCHES.items()}
    runs = {(b, p): [] for b in cases for p in ("kernel", "torch")}
    diffs = {b: (fns["kernel"]() - fns["torch"]()).abs().max().item() for b, fns in cases.items()}  # + warm-up
    with torch.inference_mode():
        for r in range(args.repeats):
            for batch, path in list(runs)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                cases[batch][path]()
                runs[batch, path].append(time.perf_counter() - t0)
    load = f"load average {load_before[0]:.1f} -> {load_average()[0]:.1f}"
    print(f"{args.threads} threads, {args.repeats} repeats, {load}")
    print(f"{'batch':<24}{'kernel ms':>11}{'torch ms':>10}{'speed-up':>10}{f'x{LAYERS} kernel':>12}"
          f"{f'x{LAYERS} torch':>11}{'max diff':>10}")  # fmt: skip
    for batch in cases:
        kernel, torch_ms = (1000 * statistics.median(runs[batch, p]) for p in ("kernel", "torch"))
        print(f"{batch:<24}{kernel:>11.3f}{torch_ms:>10.3f}{torch_ms / kernel:>9.2f}x{LAYERS * kernel:>12.2f}"
              f"{LAYERS * torch_ms:>11.2f}{diffs[batch]:>10.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
