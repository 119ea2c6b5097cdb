"""KV pull throughput between two processes, against raw gloo and a local copy; and its share of TTFT.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--model DIR] [--tokens 1024 4096] [--repeats 9] [--out JSON]

A spawned prefill process loads the `small` demo checkpoint, prefills one prompt per size (timing TTFT,
median of a few runs), holds the KV and serves KvTransfer on 127.0.0.1. This process is the decode side:
- pull: `KvTransferClient.pull` end to end over the socket: Pull RPC (the server lends the request's pool
  blocks, `PoolKv`: sent straight from the pool, no export pass) + recv, over a pair negotiated once before
  timing; each pulled tensor is handed back with `recycle`, as a decode worker does after importing it;
- posted pull: the same pull given the token count (`num_tokens`), as a decode worker pulls: its receives
  are posted before the Pull RPC and the server sends into them at once (shared/kv/transfer/posted.py);
- pull, export copy: the same, but the server first copies the blocks out (`Engine.export_kv`, the path
  before the pool-direct send, and still CUDA's);
- pull, pre-exported: the source answers with a copy exported beforehand: the transfer plane's own cost;
- shm pull: a client on the same host takes the pair's shared segment: the server gathers the blocks
  into it, the reply says so, the result is a view of the segment (dropped after each repeat); its Pull goes
  over the server's Unix socket (shared/kv/transfer/local_stream.py);
- shm pull, gRPC: the same with `local_stream=False`, its Pull a message of the pair's PullStream RPC;
- shm + import: the shm pull, then its import into a decode pool (`KVPool.write_export`, as `Engine.import_kv`
  writes it): the segment's whole same-host hand-off, two copies (the gather into the segment, the import);
- borrowed + import: the same-host hand-off with the prefill pool mapped (shared/kv/transfer/borrow.py): the
  pull answers the block ids, the import copies them from the prefill pool straight into the decode pool (one
  copy), then the release; the prefill pool lives in a memfd (`kv_shared_memory`), as a prefill worker's does;
  both hand-offs are timed twice: in the rotation, and apart, each kind back to back after the local copies,
  as the copy they are compared with is (on two cores, a transfer right before a hand-off slows it);
- export: `Engine.export_kv` alone, in the prefill process;
- raw gloo: the same bytes between the same two processes on a second two-rank gloo group: we send a
  16-byte "go", the prefill side answers with a preallocated tensor; timed from the go to the recv's end;
- clone: `tensor.clone()` of a tensor of the same size in this process (fresh memory: page faults above
  glibc's mmap threshold); copy: `out.copy_(tensor)` into memory reused across repeats, the plain memory
  copy the shared-memory path is compared with (and the least any hand-off into a decode pool costs).
A first row of FIXED_TOKENS (one block) shows the per-pull fixed cost, with `rpc`: a pull of an unknown
request (the round trip with its ticket checks, NOT_FOUND) on the pair's PullStream, the same as a unary Pull
call (how every pull went before the stream), the same over a same-host pair's Unix socket, and its parts
measured in this process.
The bench source never frees the KV (its end_send only takes back its staging), so each repeat pulls the
same blocks again. Repeats alternate the transfers, in an order rotated each repeat; the local copies are
timed after them, apart. Each figure is the median, after one warm-up of each.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.borrowed_kv import BorrowedKv  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_export import KVExport  # noqa: E402
from shared.engine.kv_pool import KVLayout, KVPool, block_runs  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.kv.tickets import Tickets  # noqa: E402
from shared.kv.transfer import KvTransferClient, KvTransferError, KvTransferServer, TransferBackend  # noqa: E402
from shared.kv.transfer.buffers import BufferPool  # noqa: E402
from shared.kv.transfer.pair import DECODE_RANK, PREFILL_RANK, Pair  # noqa: E402
from shared.kv.transfer.pool_kv import PoolKv  # noqa: E402
from shared.rpc import kv_transfer_pb2 as pb  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 120.0
SECRET = b"kv-transfer-bench-secret"  # both sides sign and check tickets, as workers do
TTFT_REPEATS = 3
FIXED_TOKENS = 16  # one block: the per-pull fixed cost
GO_TAG = 1  # raw gloo: "go" messages; payloads use GO_TAG + 1 + index of the prompt size


def prepare_model(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    return ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")


# ---- prefill process --------------------------------------------------------------------------------------


class BenchSource:
    """KvSource over held requests that never frees them, so every repeat pulls the same KV again.
    "kv-<n>": the pool blocks (PoolKv, as EngineKvBlocks lends them); "export-<n>": an export copy of them;
    "<id>#<anything>": <id> (a hand-off of its own: the borrowed pulls, each a loan until its release);
    ids in `staged` answer with that export (no copy)."""

    def __init__(self, engine: Engine, staged: dict[str, KVExport]) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.staged = staged
        # As the prefill worker (EngineKvBlocks) does: exports copy into buffers reused across pulls.
        self.buffers = BufferPool(1 << 30, "cpu")
        self.lent: dict[str, torch.Tensor] = {}

    def is_sending(self, request_id: str) -> bool:
        return False  # the bench pulls one request at a time

    async def begin_send(self, request_id: str) -> KVExport | PoolKv:
        # "<id>#<i>": <id> under a name of its own, as every hand-off of a real source is (a loan is keyed by it)
        sent_as, request_id = request_id, request_id.partition("#")[0]
        if request_id in self.staged:
            return self.staged[request_id]
        if request_id.startswith("export-"):  # a copy, as a pull made before the pool-direct send
            kv = self.engine.export_kv(request_id.replace("export-", "kv-"), alloc=self.buffers.take)
            self.lent[sent_as] = kv.blocks
            return kv
        num_tokens, block_ids, first_block = self.engine.kv_blocks(request_id)
        lent = PoolKv.plan(self.engine.pool, num_tokens, block_ids, self.buffers.take, first_block=first_block)
        if lent.staging is not None:
            self.lent[sent_as] = lent.staging
        return lent

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
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=max(sizes)),
        num_kv_blocks=-(-2 * sum(sizes) // 16),
        max_model_len=max(sizes) + 16,
        kv_shared_memory=True,  # as a prefill worker's pool: same-host pulls may borrow its blocks
    )
    timings: dict[str, dict] = {"ttft": {}, "export": {}, "runs": {}, "mode": {}}
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
        _, ids, _ = engine.kv_blocks(f"kv-{n}")
        timings["runs"][n] = len(block_runs(ids))
        timings["mode"][n] = PoolKv.plan(engine.pool, n, ids, alloc=pool.take).mode
    raw_store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    asyncio.run(serve(conn, BenchSource(engine, staged), raw_store, timings))


async def serve(conn, source: BenchSource, raw_store: dist.TCPStore, timings: dict) -> None:
    pool = source.engine.pool.handle()
    server = KvTransferServer(HOST, 0, source, secret=SECRET, timeout_s=TIMEOUT_S, shared_pool=pool)
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


# pulls timed per size; plus "raw", "clone" and "copy"
KINDS = ("pull", "posted", "pull_export", "pull_staged", "shm", "shm_grpc", "shm_import", "borrow")
HAND_OFFS = ("shm_import", "borrow")  # timed to the KV written into a decode pool, not to the pull's reply


async def measure(info: dict, sizes: list[int], repeats: int) -> tuple[list[dict], dict]:
    layout = KVLayout(**info["layout"])
    address = info["address"]
    client = KvTransferClient("bench-decode", secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=False)
    shm = KvTransferClient("bench-decode-shm", secret=SECRET, timeout_s=TIMEOUT_S, borrow=False)
    shm_grpc = KvTransferClient(
        "bench-decode-shm-grpc", secret=SECRET, timeout_s=TIMEOUT_S, local_stream=False, borrow=False
    )
    borrow = KvTransferClient("bench-decode-borrow", secret=SECRET, timeout_s=TIMEOUT_S)
    by_kind = {"pull": client, "posted": client, "pull_export": client, "pull_staged": client}
    by_kind |= {"shm": shm, "shm_grpc": shm_grpc, "shm_import": shm, "borrow": borrow}
    # the decode pool hand-offs are imported into (its blocks touched by the warm-up imports)
    decode_pool = KVPool(layout, -(-max(sizes) // layout.block_size))
    store = dist.TCPStore(HOST, info["raw_port"], is_master=False)
    raw = await asyncio.to_thread(Pair.join, TransferBackend.GLOO, store, "raw", DECODE_RANK, TIMEOUT_S, HOST)
    rows = []
    try:
        for index, n in enumerate(sizes):
            pulls = {"pull": f"kv-{n}", "posted": f"kv-{n}", "pull_export": f"export-{n}", "pull_staged": f"staged-{n}"}
            pulls["shm"] = pulls["shm_grpc"] = pulls["shm_import"] = pulls["borrow"] = f"kv-{n}"
            into = list(range(-(-n // layout.block_size)))  # the decode pool's blocks for this prompt: one run
            expect = {"posted": n}  # the token count a decode worker knows: its receives are posted first
            shm_before, local_before = shm.stats.shm_pulls, shm.stats.local_pulls
            grpc_before = shm_grpc.stats.shm_pulls
            warm = {
                k: await by_kind[k].pull(address, rid, layout, num_tokens=expect.get(k)) for k, rid in pulls.items()
            }
            raw_buffer = torch.empty_like(warm["pull"].blocks)
            raw_pull(raw, index, raw_buffer)
            assert all(torch.equal(kv.blocks, raw_buffer) for kv in warm.values()), "different bytes arrived"
            assert isinstance(warm["borrow"], BorrowedKv), "the same-host pull did not borrow the pool's blocks"
            for key in HAND_OFFS:
                decode_pool.tensor.zero_()
                decode_pool.write_export(into, warm[key])
                assert torch.equal(decode_pool.read(into), raw_buffer), f"{key} imported other bytes"
            assert shm.stats.shm_pulls == shm_before + 2, "the same-host pull did not go through shared memory"
            assert shm_grpc.stats.shm_pulls == grpc_before + 1, "the same-host pull did not go through shared memory"
            assert shm.stats.local_pulls == local_before + 2, "the same-host Pull did not go over the Unix socket"
            assert shm_grpc.stats.local_pulls == 0, "local_stream=False took the Unix socket"
            assert client.stats.abandoned_posts == 0, "a posted pull's receives went unused"
            nbytes = raw_buffer.numel() * raw_buffer.element_size()
            for kv in warm.values():
                client.recycle(kv)  # a shared-memory one frees its region when dropped; recycle ignores it
            warm.clear()
            kinds_timed = (*KINDS, "raw", "clone", "copy", *(f"{k}_apart" for k in HAND_OFFS))
            times: dict[str, list[float]] = {k: [] for k in kinds_timed}
            copy_buffer = torch.empty_like(raw_buffer)
            copy_buffer.copy_(raw_buffer)  # touched once: no page faults while timing
            # The transfers rotate their order each repeat, so none always follows the same one; the local
            # copies run apart, after them: a torch copy leaves this process's OpenMP threads spinning for a
            # while, which on two cores slowed whichever transfer came next (kinds measured right after one
            # were penalised, the others not: the contradiction between this bench and kv_link_bench).
            kinds = [*pulls, "raw"]
            for r in range(repeats):
                for key in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    if key == "raw":
                        times["raw"].append(await asyncio.to_thread(raw_pull, raw, index, raw_buffer))
                        continue
                    t0 = time.perf_counter()
                    rid = f"{pulls[key]}#{r}" if key == "borrow" else pulls[key]  # its own loan each time
                    kv = await by_kind[key].pull(address, rid, layout, num_tokens=expect.get(key))
                    if key in HAND_OFFS:  # as the decode worker's import writes it (here, not on an engine thread)
                        decode_pool.write_export(into, kv)
                    times[key].append(time.perf_counter() - t0)
                    by_kind[key].recycle(kv)  # as a decode worker does once the KV is imported (a loan: released)
                    del kv
            for _ in range(repeats):
                times["clone"].append(median_s(raw_buffer.clone, 1))
                times["copy"].append(median_s(functools.partial(copy_buffer.copy_, raw_buffer), 1))
            for key in HAND_OFFS:  # each kind back to back, as the copy it is compared with: no other kind before
                for r in range(repeats):
                    t0 = time.perf_counter()
                    kv = await by_kind[key].pull(address, f"{pulls[key]}#apart{r}", layout)
                    decode_pool.write_export(into, kv)
                    times[f"{key}_apart"].append(time.perf_counter() - t0)
                    by_kind[key].recycle(kv)
                    del kv
            seconds = {k: statistics.median(v) for k, v in times.items()}
            rows.append(row(n, nbytes, seconds, info, n))
        fixed = await fixed_cost(client, shm, address, layout, repeats)
        await asyncio.to_thread(raw.send, [torch.tensor([-1, 0])], GO_TAG)
    finally:
        for each in (client, shm, shm_grpc, borrow):
            await each.close()
    return rows, fixed


async def fixed_cost(
    client: KvTransferClient, local: KvTransferClient, address: str, layout: KVLayout, repeats: int
) -> dict:
    """What a pull costs besides its bytes: the pull's round trip (an unknown request: one message on the pair's
    PullStream, its ticket minted and verified, the checks, NOT_FOUND), the same over a same-host pair's Unix
    socket (`local`), the same as one unary Pull call, and, in this process, minting and verifying one ticket."""

    async def refused(puller: KvTransferClient) -> list[float]:
        seconds = []
        for _ in range(repeats * 3):
            t0 = time.perf_counter()
            try:
                await puller.pull(address, "no-such-request", layout)
            except KvTransferError:
                pass
            seconds.append(time.perf_counter() - t0)
        return seconds

    rpc, over_socket = await refused(client), await refused(local)
    assert (await local._connection(address, layout)).link.local, "the same-host pair does not pull over its socket"
    # The same refused pull as one unary Pull call on the same pair, the way every pull went before PullStream.
    conn = await client._connection(address, layout)
    unary = []
    for _ in range(repeats * 3):
        request = pb.PullRequest(
            request_id="no-such-request",
            ticket=client._tickets.mint(client.worker_id, "no-such-request"),
            decode_worker_id=client.worker_id,
            pair_id=conn.pair.pair_id,
            layout_fingerprint=layout.fingerprint,
        )
        t0 = time.perf_counter()
        try:
            await conn.stub.Pull(request, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            assert e.code() is grpc.StatusCode.NOT_FOUND, e
        unary.append(time.perf_counter() - t0)
    tickets = Tickets(SECRET)
    mint = median_s(lambda: tickets.mint("d", "r"), 200)
    ticket = tickets.mint("d", "r")
    verify = median_s(lambda: tickets.verify(ticket, "d", "r"), 200)
    return dict(
        rpc_ms=statistics.median(rpc) * 1e3,
        local_rpc_ms=statistics.median(over_socket) * 1e3,
        unary_rpc_ms=statistics.median(unary) * 1e3,
        ticket_mint_us=mint * 1e6,
        ticket_verify_us=verify * 1e6,
    )


def row(tokens: int, nbytes: int, seconds: dict[str, float], info: dict, n: int) -> dict:
    gbps = {f"{k}_gbps": nbytes / s / 1e9 for k, s in seconds.items()}
    ttft = info["ttft"][n]
    return dict(
        tokens=tokens,
        bytes=nbytes,
        runs=info["runs"][n],
        mode=info["mode"][n],
        **{f"{k}_ms": s * 1e3 for k, s in seconds.items()},
        **gbps,
        pull_vs_raw=seconds["raw"] / seconds["pull"],
        posted_vs_raw=seconds["raw"] / seconds["posted"],
        pull_export_vs_raw=seconds["raw"] / seconds["pull_export"],
        pull_staged_vs_raw=seconds["raw"] / seconds["pull_staged"],
        shm_vs_pull=seconds["pull"] / seconds["shm"],
        shm_vs_clone=seconds["clone"] / seconds["shm"],
        shm_vs_copy=seconds["copy"] / seconds["shm"],
        shm_grpc_vs_copy=seconds["copy"] / seconds["shm_grpc"],
        shm_import_vs_copy=seconds["copy"] / seconds["shm_import"],
        borrow_vs_copy=seconds["copy"] / seconds["borrow"],
        borrow_vs_shm_import=seconds["shm_import"] / seconds["borrow"],
        shm_import_apart_vs_copy=seconds["copy"] / seconds["shm_import_apart"],
        borrow_apart_vs_copy=seconds["copy"] / seconds["borrow_apart"],
        export_ms=info["export"][n] * 1e3,
        ttft_ms=ttft * 1e3,
        pull_share_of_ttft=seconds["pull"] / ttft,
        shm_share_of_ttft=seconds["shm"] / ttft,
    )


def print_table(rows: list[dict], fixed: dict) -> None:
    print(
        "| prompt tokens | KV (runs, way) | raw gloo | pull | pull / raw | posted pull | posted / raw "
        "| pull, export copy | export / raw "
        "| pre-exported / raw | shm pull | shm / pull | copy | shm / copy | shm pull, gRPC | shm, gRPC / copy "
        "| clone | TTFT | pull / TTFT |"
    )
    print("| ---: " * 19 + "|")
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['bytes'] / 1e6:.2f} MB ({r['runs']}, {r['mode']})"]
        cells += [f"{r[k + '_ms']:.2f} ms, {r[k + '_gbps']:.2f} GB/s" for k in ("raw", "pull")]
        cells += [f"{r['pull_vs_raw']:.0%}", f"{r['posted_ms']:.2f} ms", f"{r['posted_vs_raw']:.0%}"]
        cells += [f"{r['pull_export_ms']:.2f} ms", f"{r['pull_export_vs_raw']:.0%}"]
        cells += [f"{r['pull_staged_vs_raw']:.0%}", f"{r['shm_ms']:.2f} ms, {r['shm_gbps']:.2f} GB/s"]
        cells += [f"{r['shm_vs_pull']:.1f}x", f"{r['copy_ms']:.2f} ms, {r['copy_gbps']:.2f} GB/s"]
        cells += [f"{r['shm_vs_copy']:.0%}", f"{r['shm_grpc_ms']:.2f} ms", f"{r['shm_grpc_vs_copy']:.0%}"]
        cells += [f"{r['clone_ms']:.2f} ms, {r['clone_gbps']:.2f} GB/s", f"{r['ttft_ms']:.0f} ms"]
        cells += [f"{r['pull_share_of_ttft']:.1%}"]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        "| prompt tokens | KV | copy | shm pull | shm pull + import | shm + import / copy | borrowed + import "
        "| borrowed / copy | borrowed vs shm + import | shm + import, apart | borrowed + import, apart "
        "| apart: shm / copy, borrowed / copy |"
    )
    print("| ---: " * 12 + "|")
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['bytes'] / 1e6:.2f} MB"]
        cells += [f"{r[k + '_ms']:.2f} ms, {r[k + '_gbps']:.2f} GB/s" for k in ("copy", "shm", "shm_import")]
        cells += [f"{r['shm_import_vs_copy']:.0%}", f"{r['borrow_ms']:.2f} ms, {r['borrow_gbps']:.2f} GB/s"]
        cells += [f"{r['borrow_vs_copy']:.0%}", f"{r['borrow_vs_shm_import']:.2f}x"]
        cells += [f"{r['shm_import_apart_ms']:.2f} ms", f"{r['borrow_apart_ms']:.2f} ms"]
        cells += [f"{r['shm_import_apart_vs_copy']:.0%}, {r['borrow_apart_vs_copy']:.0%}"]
        print("| " + " | ".join(cells) + " |")
    print(
        f"fixed cost: pull round trip (NOT_FOUND) {fixed['rpc_ms']:.2f} ms on the pair's PullStream, "
        f"{fixed['local_rpc_ms']:.2f} ms on a same-host pair's Unix socket, "
        f"{fixed['unary_rpc_ms']:.2f} ms as a unary Pull; "
        f"ticket mint {fixed['ticket_mint_us']:.1f} us, verify {fixed['ticket_verify_us']:.1f} us"
    )


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
    sizes = [FIXED_TOKENS, *args.tokens]  # the first row: the per-pull fixed cost
    proc = ctx.Process(target=prefill_main, args=(theirs, str(model_dir), sizes, args.repeats), daemon=True)
    proc.start()
    theirs.close()  # ours only: a prefill process that dies ends our recv (EOFError) instead of hanging it
    try:
        info = ours.recv()
        rows, fixed = asyncio.run(measure(info, sizes, args.repeats))
        ours.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    print_table(rows, fixed)
    result = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        model=str(model_dir),
        repeats=args.repeats,
        cpu=cpu_model(),
        rows=rows,
        fixed_cost=fixed,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
