"""KV pull throughput between two processes, against raw gloo and a local copy; and its share of TTFT.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--model DIR] [--tokens 1024 4096] [--repeats 9] [--out JSON]

A spawned prefill process loads the `small` demo checkpoint, prefills one prompt per size (timing TTFT,
median of a few runs), holds the KV and serves KvTransfer on 127.0.0.1. This process is the decode side:
- pull: `KvTransferClient.pull` end to end: Pull RPC (the server exports a copy of the blocks with
  `Engine.export_kv`, announces them and starts the send) + recv, over a pair negotiated once before timing;
  each pulled tensor is handed back with `recycle`, as a decode worker does after importing it;
- pull, pre-exported: the same, but the source answers with a copy exported beforehand: the transfer
  plane's own cost (RPC + wire), without the engine's gather of the blocks;
- export: `Engine.export_kv` alone, in the prefill process;
- raw gloo: the same bytes between the same two processes on a second two-rank gloo group: we send a
  16-byte "go", the prefill side answers with a preallocated tensor; timed from the go to the recv's end;
- clone: `tensor.clone()` of a tensor of the same size in this process (memory-copy bound).
The bench source never frees the KV (its end_send only takes back the copy's buffer), so each repeat
pulls the same blocks again.
Repeats alternate pull / raw / clone; each figure is the median, after one warm-up of each.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_export import KVExport  # noqa: E402
from shared.engine.kv_pool import KVLayout  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.kv.transfer import KvTransferClient, KvTransferServer, TransferBackend  # noqa: E402
from shared.kv.transfer.buffers import BufferPool  # noqa: E402
from shared.kv.transfer.pair import DECODE_RANK, PREFILL_RANK, Pair  # noqa: E402
from shared.model.demo import ensure_demo_checkpoint  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 120.0
SECRET = b"kv-transfer-bench-secret"  # both sides sign and check tickets, as workers do
TTFT_REPEATS = 3
GO_TAG = 1  # raw gloo: "go" messages; payloads use GO_TAG + 1 + index of the prompt size


def prepare_model(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    return ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")


# ---- prefill process --------------------------------------------------------------------------------------


class BenchSource:
    """KvSource over held requests that never frees them, so every repeat pulls the same KV again.
    Ids in `staged` answer with that export (no copy); the others export from the engine on each pull."""

    def __init__(self, engine: Engine, staged: dict[str, KVExport]) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.staged = staged
        # As the prefill worker (EngineKvBlocks) does: exports copy into buffers reused across pulls.
        self.buffers = BufferPool(1 << 30, "cpu")
        self.lent: dict[str, torch.Tensor] = {}

    def is_sending(self, request_id: str) -> bool:
        return False  # the bench pulls one request at a time

    async def begin_send(self, request_id: str) -> KVExport:
        if request_id in self.staged:
            return self.staged[request_id]
        kv = self.engine.export_kv(request_id, alloc=self.buffers.take)  # a copy, as a real pull makes
        self.lent[request_id] = kv.blocks
        return kv

    async def end_send(self, request_id: str, ok: bool) -> None:
        if request_id in self.lent:  # the send is over; the KV itself stays held for the next repeat
            self.buffers.give_back(self.lent.pop(request_id))


def prefill_ttft(engine: Engine, rid: str, prompt: list[int], hold: bool) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=hold)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_main(conn, model_dir: str, sizes: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    engine = Engine.from_dir(
        model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=max(sizes)), num_kv_blocks=-(-2 * sum(sizes) // 16)
    )
    timings: dict[str, dict[int, float]] = {"ttft": {}, "export": {}}
    staged = {}
    for n in sizes:
        prompt = torch.randint(0, 256, (n,)).tolist()
        times = [prefill_ttft(engine, f"warm-{n}-{i}", prompt, hold=False) for i in range(TTFT_REPEATS)]
        timings["ttft"][n] = statistics.median(times)
        prefill_ttft(engine, f"kv-{n}", prompt, hold=True)
        pool = BufferPool(1 << 30, "cpu")  # export into reused memory, as the source above does

        def export(n=n, pool=pool) -> None:
            pool.give_back(engine.export_kv(f"kv-{n}", alloc=pool.take).blocks)

        timings["export"][n] = median_s(export, repeats)
        staged[f"staged-{n}"] = engine.export_kv(f"kv-{n}")
    raw_store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    asyncio.run(serve(conn, BenchSource(engine, staged), raw_store, timings))


async def serve(conn, source: BenchSource, raw_store: dist.TCPStore, timings: dict) -> None:
    server = KvTransferServer(HOST, 0, source, secret=SECRET, timeout_s=TIMEOUT_S)
    address = await server.start()
    layout = dataclasses.asdict(source.layout)
    conn.send(dict(address=address, raw_port=raw_store.port, layout=layout, **timings))
    payloads = [kv.blocks for kv in source.staged.values()]  # the same bytes, in the order of the sizes
    raw = threading.Thread(target=raw_sender, args=(raw_store, payloads), daemon=True)
    raw.start()
    await asyncio.to_thread(conn.recv)  # "stop"
    await server.stop()


def raw_sender(store: dist.TCPStore, payloads: list[torch.Tensor]) -> None:
    """Answer each "go" (index of a payload, or -1 to end) with that payload."""
    pair = Pair.join(TransferBackend.GLOO, store, "raw", PREFILL_RANK, TIMEOUT_S, HOST)
    go = torch.zeros(2, dtype=torch.int64)
    while True:
        pair.recv([go], GO_TAG)
        index = int(go[0])
        if index < 0:
            return
        pair.send([payloads[index]], GO_TAG + 1 + index)


# ---- decode process (this one) ----------------------------------------------------------------------------


def raw_pull(pair: Pair, index: int, out: torch.Tensor) -> float:
    t0 = time.perf_counter()
    pair.send([torch.tensor([index, 0])], GO_TAG)
    pair.recv([out], GO_TAG + 1 + index)
    return time.perf_counter() - t0


async def measure(info: dict, sizes: list[int], repeats: int) -> list[dict]:
    layout = KVLayout(**info["layout"])
    client = KvTransferClient("bench-decode", secret=SECRET, timeout_s=TIMEOUT_S)
    store = dist.TCPStore(HOST, info["raw_port"], is_master=False)
    raw = await asyncio.to_thread(Pair.join, TransferBackend.GLOO, store, "raw", DECODE_RANK, TIMEOUT_S, HOST)
    rows = []
    try:
        for index, n in enumerate(sizes):
            pulls = {"pull": f"kv-{n}", "pull_staged": f"staged-{n}"}
            warm = {k: await client.pull(info["address"], rid, layout) for k, rid in pulls.items()}
            raw_buffer = torch.empty_like(warm["pull"].blocks)
            raw_pull(raw, index, raw_buffer)
            assert all(torch.equal(kv.blocks, raw_buffer) for kv in warm.values()), "different bytes arrived"
            nbytes = raw_buffer.numel() * raw_buffer.element_size()
            for kv in warm.values():
                client.recycle(kv)
            times: dict[str, list[float]] = {"pull": [], "pull_staged": [], "raw": [], "clone": []}
            for _ in range(repeats):
                for key, rid in pulls.items():
                    t0 = time.perf_counter()
                    kv = await client.pull(info["address"], rid, layout)
                    times[key].append(time.perf_counter() - t0)
                    client.recycle(kv)  # as a decode worker does once the KV is imported
                times["raw"].append(await asyncio.to_thread(raw_pull, raw, index, raw_buffer))
                times["clone"].append(median_s(raw_buffer.clone, 1))
            seconds = {k: statistics.median(v) for k, v in times.items()}
            rows.append(row(n, nbytes, seconds, info["ttft"][n], info["export"][n]))
        await asyncio.to_thread(raw.send, [torch.tensor([-1, 0])], GO_TAG)
    finally:
        await client.close()
    return rows


def row(tokens: int, nbytes: int, seconds: dict[str, float], ttft: float, export: float) -> dict:
    gbps = {f"{k}_gbps": nbytes / s / 1e9 for k, s in seconds.items()}
    return dict(
        tokens=tokens,
        bytes=nbytes,
        **{f"{k}_ms": s * 1e3 for k, s in seconds.items()},
        **gbps,
        pull_vs_raw=seconds["raw"] / seconds["pull"],
        pull_staged_vs_raw=seconds["raw"] / seconds["pull_staged"],
        export_ms=export * 1e3,
        ttft_ms=ttft * 1e3,
        pull_share_of_ttft=seconds["pull"] / ttft,
    )


def print_table(rows: list[dict]) -> None:
    print(
        "| prompt tokens | KV | raw gloo | pull | pull / raw | pull, pre-exported | pre-exported / raw "
        "| export alone | clone | TTFT | pull / TTFT |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['bytes'] / 1e6:.1f} MB"]
        cells += [f"{r[k + '_ms']:.1f} ms, {r[k + '_gbps']:.2f} GB/s" for k in ("raw", "pull")]
        cells += [f"{r['pull_vs_raw']:.0%}", f"{r['pull_staged_ms']:.1f} ms, {r['pull_staged_gbps']:.2f} GB/s"]
        cells += [f"{r['pull_staged_vs_raw']:.0%}", f"{r['export_ms']:.1f} ms"]
        cells += [f"{r['clone_ms']:.1f} ms, {r['clone_gbps']:.2f} GB/s", f"{r['ttft_ms']:.0f} ms"]
        cells += [f"{r['pull_share_of_ttft']:.1%}"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the small demo model, written if missing)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_transfer.json"))
    args = parser.parse_args()
    model_dir = prepare_model(args.model)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(theirs, str(model_dir), args.tokens, args.repeats), daemon=True)
    proc.start()
    try:
        info = ours.recv()
        rows = asyncio.run(measure(info, args.tokens, args.repeats))
        ours.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    print_table(rows)
    result = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        model=str(model_dir),
        repeats=args.repeats,
        rows=rows,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
