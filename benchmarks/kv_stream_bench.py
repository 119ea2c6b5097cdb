"""Layer-streamed KV hand-off: time from prefill start to "decode may begin", against the prefill alone.

    .venv/bin/python benchmarks/kv_stream_bench.py [--model DIR] [--tokens 1024 4096] [--repeats 7] [--out JSON]

A spawned prefill process loads the `small` demo checkpoint (8 layers), steps its engine on a thread of its
own (as a prefill worker does) and serves KvTransfer on 127.0.0.1; this process is the decode side, with a
pair negotiated before timing. Per prompt size, side by side in one run (the kinds alternate per repeat):
- alone: the prefill of the prompt to its first token (chunks of `--chunk` tokens), nothing handed off;
- unstreamed: the prefill, then (KV held, the hand-off announced) the pull of its KV, as today: timed from
  the prefill's start to the pull's end (the pull sent straight from the pool's blocks, PoolKv);
- streamed: the prompt is watched (EngineKvBlocks.watch): the hand-off is announced when its last chunk
  starts, the pull begins then and receives each layer as the forward pass writes it, then the first token
  (layer_stream.py); timed from the prefill's start to the pull's end ("decode may begin").
The announcement travels over a pipe (about 0.1 ms) where a deployment has NATS + Redis + the decode worker's
queue; both handed-off kinds pay it once. Times are taken with time.monotonic in both processes (one clock on
Linux). Each figure is the median over the repeats, after one warm-up of each kind.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_pool import KVLayout  # noqa: E402
from shared.engine.layer_streams import StreamStart  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.kv.held import HeldKv  # noqa: E402
from shared.kv.transfer import EngineKvBlocks, KvTransferClient, KvTransferServer  # noqa: E402
from shared.kv.transfer.layer_stream import StreamedKv  # noqa: E402

TIMEOUT_S = 120.0
SECRET = b"kv-stream-bench-secret-0123456789"
KINDS = ("alone", "unstreamed", "streamed")
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


def prefill_main(conn, model_dir: str, sizes: list[int], chunk: int) -> None:
    asyncio.run(serve(conn, model_dir, sizes, chunk))


async def serve(conn, model_dir: str, sizes: list[int], chunk: int) -> None:
    """Commands: (kind, rid, n) → runs that prefill; answers ("announced", t0) when decode may pull (not for
    "alone"), then ("done", t0, t_end) when the prefill's last step ended; ("stop",)."""
    torch.manual_seed(0)
    loop = asyncio.get_running_loop()
    engine = Engine.from_dir(
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        num_kv_blocks=-(-3 * max(sizes) // 16),
        max_model_len=max(sizes) + 16,
    )
    engine_thread = concurrent.futures.ThreadPoolExecutor(1)

    async def call(fn):
        return await loop.run_in_executor(engine_thread, fn, engine)

    blocks = EngineKvBlocks(engine, call=call)
    held = HeldKv(blocks, lease_s=600.0)
    server = KvTransferServer("127.0.0.1", 0, held, secret=SECRET, timeout_s=TIMEOUT_S, shm_bytes=0)
    prompts = {n: torch.randint(0, 256, (n,)).tolist() for n in sizes}
    conn.send((await server.start(), engine.layout))

    def run(e: Engine) -> float:
        while e.has_unfinished():
            e.step()
        return time.monotonic()

    try:
        while True:
            kind, *args = await asyncio.to_thread(conn.recv)
            if kind == "stop":
                break
            rid, n = args
            started: asyncio.Future[None] = loop.create_future()

            def add(e: Engine, kind=kind, rid=rid, n=n, started=started) -> float:
                e.add_request(rid, prompts[n], PREFILL, hold_kv=kind != "alone")
                if kind == "streamed":

                    def announce(_: StreamStart) -> None:
                        loop.call_soon_threadsafe(started.set_result, None)

                    blocks.watch(e, rid, announce)
                return time.monotonic()

            t0 = await call(add)
            prefill = asyncio.ensure_future(call(run))
            if kind == "streamed":
                await started
            t_end = await prefill if kind != "streamed" else None
            if kind == "alone":
                await call(lambda e, rid=rid: e.release_kv(rid))
            else:
                await held.hold(rid, rid, 0)
                conn.send(("announced", t0))
            t_end = t_end or await prefill
            conn.send(("done", t0, t_end))
    finally:
        await server.stop()


async def measure(address: str, layout: KVLayout, conn, sizes: list[int], repeats: int) -> dict:
    client = KvTransferClient("bench-decode", secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=False)
    results: dict[int, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in sizes}
    prefill_in_handoff: dict[int, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in sizes}
    count = 0
    try:
        for repeat in range(repeats + 1):  # the first is the warm-up
            for n in sizes:
                for kind in KINDS:
                    count += 1
                    rid = f"{kind}-{n}-{count}"
                    conn.send((kind, rid, n))
                    if kind == "alone":
                        _, t0, t_end = await asyncio.to_thread(conn.recv)
                        elapsed, prefill_s = t_end - t0, t_end - t0
                    else:
                        _, t0 = await asyncio.to_thread(conn.recv)
                        kv = await client.pull(address, rid, layout)
                        t_pulled = time.monotonic()
                        assert isinstance(kv, StreamedKv) == (kind == "streamed")
                        client.recycle(kv)
                        _, _, t_end = await asyncio.to_thread(conn.recv)
                        elapsed, prefill_s = t_pulled - t0, t_end - t0
                    if repeat:
                        results[n][kind].append(elapsed)
                        prefill_in_handoff[n][kind].append(prefill_s)
    finally:
        await client.close()
    return {
        n: {
            kind: {
                "median_s": statistics.median(results[n][kind]),
                "prefill_median_s": statistics.median(prefill_in_handoff[n][kind]),
            }
            for kind in KINDS
        }
        for n in sizes
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the small demo model, written if missing)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_stream.json"))
    args = parser.parse_args()
    model = Path(args.model) if args.model else ensure_demo_checkpoint(
        REPO / "models" / "demo-small-qwen3_moe", size="small"
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(theirs, str(model), args.tokens, args.chunk), daemon=True)
    proc.start()
    try:
        address, layout = ours.recv()
        figures = asyncio.run(measure(address, layout, ours, args.tokens, args.repeats))
        ours.send(("stop",))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    load = os.getloadavg()
    print(f"CPU: {cpu}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; chunk {args.chunk} tokens")
    head = ("tokens", "alone ms", "unstreamed ms", "streamed ms", "unstr/alone", "str/alone")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (7, 9, 14, 12, 12, 10), strict=True)))
    for n, row in figures.items():
        alone, unstreamed, streamed = (row[k]["median_s"] * 1e3 for k in KINDS)
        print(
            f"{n:>7} {alone:>9.1f} {unstreamed:>14.1f} {streamed:>12.1f} "
            f"{unstreamed / alone:>12.2f} {streamed / alone:>10.2f}"
        )
    out = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "load_average": load,
        "chunk_tokens": args.chunk,
        "repeats": args.repeats,
        "figures": {str(n): row for n, row in figures.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
