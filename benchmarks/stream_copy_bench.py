"""The same-host send's gather, streamed or plain, by size: where streaming stores start to pay.

    .venv/bin/python benchmarks/stream_copy_bench.py [--tokens 256 1024 4096 8192] [--repeats 31] [--out JSON]

In one process, a pool shaped like the `small` demo's KV (8 layers, K and V, 2 KV heads of 64, float32 blocks
of 16 tokens: 8 KiB a token, 33.5 MB for 4096) holds a request's consecutive blocks; each repeat gathers them
into a reused buffer (`PoolKv.copy_into`), once with streaming stores (cpu_stream_copy.c) and once with
torch's copy, then reads the result out into another part of a pool, as the decode side imports what arrived
in the shared segment. Printed per size: the gather alone and gather + read, both ways, medians; and the size
from which the send streams on this host (`cpu_stream_copy.min_bytes()`). A single process on a warm cache:
the reader here shares this core's caches, as a decode process on the same socket shares the last level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.host_info import cpu_info, describe, load_average  # noqa: E402
from shared.engine.kv_pool import KVLayout, KVPool  # noqa: E402
from shared.kv.transfer.pool_kv import PoolKv  # noqa: E402
from shared.model.kernels import cpu_stream_copy  # noqa: E402

LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")


def measure(tokens: int, repeats: int, pool: KVPool, imported: torch.Tensor) -> dict:
    blocks = tokens // LAYOUT.block_size
    kv = PoolKv(LAYOUT, tokens, pool, list(range(blocks)), "direct")
    out = torch.zeros(kv.shape, dtype=LAYOUT.torch_dtype)  # touched: no page faults while timing
    timed: dict[str, list[float]] = {k: [] for k in ("streamed", "plain", "streamed_read", "plain_read")}
    for r in range(repeats + 1):  # the first round warms up
        for way in ("streamed", "plain") if r % 2 else ("plain", "streamed"):
            t0 = time.perf_counter()
            kv.copy_into(out, streaming=way == "streamed")
            t1 = time.perf_counter()
            imported[:, :, blocks : 2 * blocks].copy_(out)  # the import, into other blocks than the source's
            t2 = time.perf_counter()
            if r:
                timed[way].append(t1 - t0)
                timed[f"{way}_read"].append(t2 - t0)
    ms = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in timed.items()}
    return {"tokens": tokens, "mb": kv.nbytes / 1e6, **ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "stream_copy.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if cpu_stream_copy.load() is None:
        sys.exit("the streaming-copy kernel does not build here (no gcc?): nothing to compare")
    largest = max(args.tokens) // LAYOUT.block_size
    pool = KVPool(LAYOUT, 2 * largest)
    pool.tensor.normal_()
    imported = torch.zeros_like(pool.tensor)
    host = cpu_info()
    print(f"{describe(host)}; load average {load_average()[0]:.1f}")
    print(f"streams from {cpu_stream_copy.min_bytes() / 1e6:.1f} MB (3/4 of the largest cache)")
    print("| tokens | KV | gather: streamed | plain | + read: streamed | plain | streamed / plain, + read |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for tokens in args.tokens:
        row = measure(tokens, args.repeats, pool, imported)
        rows.append(row)
        print(
            f"| {tokens} | {row['mb']:.1f} MB | {row['streamed_ms']:.3f} ms | {row['plain_ms']:.3f} ms "
            f"| {row['streamed_read_ms']:.3f} ms | {row['plain_read_ms']:.3f} ms "
            f"| {row['streamed_read_ms'] / row['plain_read_ms']:.2f} |"
        )
    args.out.write_text(json.dumps({"host": host, "min_bytes": cpu_stream_copy.min_bytes(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
