"""Where the milliseconds of one KV pull go: timestamps on both sides of a pull, per phase, medians.

    .venv/bin/python benchmarks/kv_pull_profile.py [--tokens 16 1024 4096] [--repeats 15] [--shm | --borrow]

The same two processes as kv_transfer_bench.py (a spawned prefill process holding the `small` demo model's KV
and serving KvTransfer on 127.0.0.1; this process pulls with `KvTransferClient`, shared memory off; with
`--shm` on, through the pair's segment, so that its Pulls go over the server's Unix socket, local_stream.py;
with `--borrow` the same-host hand-off in one copy: the pull borrows the blocks of the prefill pool and this
process imports them into a decode pool, borrow.py, timed to the import's end, beside a plain copy of as many
bytes). Both sides
stamp `time.perf_counter()` (CLOCK_MONOTONIC: one clock for every process of the host) at the phase boundaries
by wrapping the plane's own methods in this script (the library is not instrumented), so the differences across
the two processes are meaningful. Phases, in order along one pull:

- client: ticket minted and the Pull sent; server: handler entered (gRPC + loop wake-up); ticket checked;
  blocks lent (`begin_send`); reply returned; client: reply seen (gRPC back + loop wake-up);
- recv: posted (after any thread hop), done; server: sends posted, sends done; client: the pull returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import kv_transfer_bench as bench  # noqa: E402

from shared.engine.kv_pool import KVLayout, KVPool  # noqa: E402
from shared.kv.transfer import KvTransferClient  # noqa: E402
from shared.kv.transfer import call_checks as checks_mod  # noqa: E402
from shared.kv.transfer import client as client_mod  # noqa: E402
from shared.kv.transfer import pair as pair_mod  # noqa: E402
from shared.kv.transfer import server as server_mod  # noqa: E402
from shared.kv.transfer.transports import segment as segment_mod  # noqa: E402
from shared.kv.transfer.transports import sends as sends_mod  # noqa: E402

STAMPS: list[tuple[str, str, float]] = []  # (request id, phase, perf_counter)


def stamp(rid: str, phase: str) -> None:
    STAMPS.append((rid, phase, time.perf_counter()))


def patch_server() -> None:
    """Wrap the server's phases (one pull at a time, so the current request id is the one stamped)."""
    current = {"rid": ""}
    accept, authorize, begin = server_mod.KvTransferServer._accept, checks_mod.CallChecks.authorize, None
    begin = server_mod.begin_send

    async def _accept(self, request, context, span):
        current["rid"] = request.request_id
        stamp(request.request_id, "s_enter")
        reply = await accept(self, request, context, span)
        stamp(request.request_id, "s_reply")
        return reply

    async def _authorize(self, context, rpc, ticket, worker, request_id=None):
        await authorize(self, context, rpc, ticket, worker, request_id)
        stamp(request_id or "", "s_ticket")

    async def begin_send(source, request_id, request):
        kv = await begin(source, request_id, request)
        stamp(request_id, "s_lent")
        return kv

    copy, end_send = segment_mod.copy_into_region, sends_mod.Sends.end

    def copy_into_region(*args):  # the shared-memory send's gather, on a send thread
        stamp(current["rid"], "s_copy_start")
        copy(*args)
        stamp(current["rid"], "s_copy_done")

    async def _end_send(self, job, error):
        await end_send(self, job, error)
        stamp(job.request_id, "s_freed")

    server_mod.KvTransferServer._accept = _accept
    checks_mod.CallChecks.authorize = _authorize
    server_mod.begin_send = begin_send
    segment_mod.copy_into_region = copy_into_region
    sends_mod.Sends.end = _end_send
    patch_transfers(current, "s_send")


def patch_transfers(current: dict[str, str], prefix: str) -> None:
    """Stamp `<prefix>_start` when a transfer's operations are posted and `<prefix>_done` when its wait
    returns (tag 0, the pair proof, is not a pull's)."""
    post_send, post_recv, wait = pair_mod.Pair.post_send, pair_mod.Pair.post_recv, pair_mod.Posted.wait

    def stamped(post):
        def wrapper(self, pieces, first_tag):
            if first_tag:
                stamp(current["rid"], f"{prefix}_start")
            posted = post(self, pieces, first_tag)
            posted.profiled = bool(first_tag)
            return posted

        return wrapper

    def stamped_wait(self):
        wait(self)
        if getattr(self, "profiled", False):
            stamp(current["rid"], f"{prefix}_done")

    pair_mod.Pair.post_send = stamped(post_send)
    pair_mod.Pair.post_recv = stamped(post_recv)
    pair_mod.Posted.wait = stamped_wait


def prefill_entry(conn, model_dir: str, sizes: list[int], repeats: int, out: str) -> None:
    patch_server()
    bench.prefill_main(conn, model_dir, sizes, repeats)
    Path(out).write_text(json.dumps(STAMPS))


def patch_client() -> None:
    original = client_mod.KvTransferClient._call
    current = {"rid": ""}

    async def _call(self, address, conn, call, what):
        reply = await original(self, address, conn, call, what)
        if what == "Pull":  # not the Connect of the first pull
            stamp(current["rid"], "c_reply")
        return reply

    pull_once = client_mod.KvTransferClient._pull_once

    async def _pull_once(self, address, request_id, *args):
        current["rid"] = request_id
        stamp(request_id, "c_start")
        return await pull_once(self, address, request_id, *args)

    client_mod.KvTransferClient._call = _call
    client_mod.KvTransferClient._pull_once = _pull_once
    patch_transfers(current, "c_recv")


async def released(client: KvTransferClient) -> None:
    """Until a loan's release (scheduled on the loop by `recycle`) is written: before the next pull of the same id
    (a real decode worker never pulls one id twice; the server lends an id once at a time)."""
    await asyncio.sleep(0)
    while any(_releasing(task) for task in client._connections.values()):
        await asyncio.sleep(0)


def _releasing(connecting: asyncio.Task) -> bool:
    """Whether a pair's borrowed-pool receiver still has a release message being written."""
    if not connecting.done() or connecting.exception() is not None:
        return False
    borrowed = connecting.result().receiver("borrowed")
    return bool(borrowed is not None and getattr(borrowed, "_releasing", None))


async def pull_all(info: dict, sizes: list[int], repeats: int, mode: str) -> tuple[dict[str, dict[str, float]], dict]:
    """Pull each size `repeats` times (after a warm-up); → per client-side phase stamped here, {"<rid>#<i>": t},
    and per size the median of a plain copy of its bytes (the `--borrow` comparison)."""
    layout = KVLayout(**info["layout"])
    client = KvTransferClient(
        "profile-decode", secret=bench.SECRET, timeout_s=bench.TIMEOUT_S, shared_memory=mode != "socket",
        borrow=mode == "borrow",
    )  # fmt: skip
    decode_pool = KVPool(layout, -(-max(sizes) // layout.block_size))  # what a borrowed KV is imported into
    stamped: dict[str, dict[str, float]] = {"c_end": {}, "c_imported": {}}
    copies = {}
    try:
        for n in sizes:
            into = list(range(-(-n // layout.block_size)))
            # num_tokens: posted pulls, as a decode worker pulls (posted.py): its recvs go out before the Pull
            warm = await client.pull(info["address"], f"kv-{n}", layout, num_tokens=n)  # forms the pair
            decode_pool.write_export(into, warm)  # the decode pool's blocks touched once
            client.recycle(warm)
            del warm
            await released(client)
            for i in range(repeats):
                rid = f"kv-{n}"
                kv = await client.pull(info["address"], rid, layout, num_tokens=n)
                stamped["c_end"][f"{rid}#{i}"] = time.perf_counter()
                if mode == "borrow":  # the hand-off's copy: from the prefill pool into this one
                    decode_pool.write_export(into, kv)
                    stamped["c_imported"][f"{rid}#{i}"] = time.perf_counter()
                client.recycle(kv)  # a shared-memory one frees its region when dropped, next line; a loan: released
                del kv
                await released(client)
            if mode == "borrow":  # every pull lent, none through the segment (its phases are another table)
                lent = (repeats + 1) * (sizes.index(n) + 1)
                assert client.stats.borrowed_pulls == lent, f"a pull was not lent: {client.stats}"
            source = decode_pool.read(into)
            out = source.clone()
            copies[n] = bench.median_s(lambda out=out, source=source: out.copy_(source), repeats) * 1e3
    finally:
        await client.close()
    return stamped, copies


PHASES = [
    ("c_start", "s_enter", "Pull sent -> server handler (mint, gRPC, loop)"),
    ("s_enter", "s_ticket", "ticket verified + replay check"),
    ("s_ticket", "s_lent", "pair/fingerprint checks + blocks lent"),
    ("s_lent", "s_reply", "plan, tags, announce, send task created"),
    ("s_reply", "c_reply", "reply -> client loop (gRPC back)"),
    ("c_start", "c_recv_start", "client: recvs posted (before the Pull: posted pulls)"),
    ("s_lent", "s_send_start", "server: blocks lent -> sends posted"),
    ("c_recv_start", "c_recv_done", "recv posted -> all pieces in"),
    ("s_send_start", "c_recv_done", "server: sends posted -> client: all pieces in"),
    ("s_send_start", "s_send_done", "sends posted -> all out"),
    ("c_recv_done", "c_end", "recv thread -> loop -> pull returns"),
    ("c_start", "c_end", "whole pull"),
]


# the same-host path in one copy (--borrow): the reply names the blocks, this process copies them into its pool
BORROW_PHASES = [
    ("c_start", "s_enter", "Pull sent -> server handler (mint, Unix socket, loop)"),
    ("s_enter", "s_lent", "ticket, checks, blocks lent"),
    ("s_lent", "s_reply", "loan registered, block ids in the reply"),
    ("s_reply", "c_reply", "reply -> client loop (Unix socket back)"),
    ("c_reply", "c_end", "client: the borrowed KV, pull returns"),
    ("c_end", "c_imported", "import: the blocks copied from the prefill pool into the decode pool"),
    ("c_start", "c_end", "whole pull"),
    ("c_start", "c_imported", "whole hand-off (pull + import)"),
]


# the same-host path (--shm): the KV is copied into the pair's segment, then the reply says it is there
SHM_PHASES = [  # its Pull on the server's Unix socket (local_stream.py), not gRPC
    ("c_start", "s_enter", "Pull sent -> server handler (mint, Unix socket, loop)"),
    ("s_enter", "s_lent", "ticket, checks, blocks lent"),
    ("s_lent", "s_copy_start", "-> region view (a send thread above 64 MiB)"),
    ("s_copy_start", "s_copy_done", "gather into the segment"),
    ("s_copy_done", "s_freed", "-> loop + blocks freed"),
    ("s_freed", "s_reply", "reply built"),
    ("s_reply", "c_reply", "reply -> client loop (Unix socket back)"),
    ("c_reply", "c_end", "client: view of the segment, pull returns"),
    ("c_start", "c_end", "whole pull"),
]


def summarize(
    stamps: list[tuple[str, str, float]], stamped: dict[str, dict[str, float]], sizes: list[int], repeats: int, phases
) -> dict:
    """Group the stamps into pulls (the n-th occurrence of each phase of one request id is pull n), drop the
    warm-up, take medians of each phase's duration."""
    by_rid: dict[str, dict[str, list[float]]] = {}
    for rid, phase, t in stamps:
        by_rid.setdefault(rid, {}).setdefault(phase, []).append(t)
    table = {}
    for n in sizes:
        rid = f"kv-{n}"
        seen = by_rid[rid]
        for phase, times in stamped.items():  # the warm-up is stamped by the wrappers only
            if times:
                seen[phase] = [0.0] + [times[f"{rid}#{i}"] for i in range(repeats)]
        rows = {}
        for a, b, what in phases:
            durations = [(seen[b][i] - seen[a][i]) * 1e3 for i in range(1, repeats + 1)]
            rows[what] = statistics.median(durations)
        table[n] = rows
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    same_host = parser.add_mutually_exclusive_group()
    same_host.add_argument("--shm", action="store_true", help="profile the same-host path through the segment")
    same_host.add_argument("--borrow", action="store_true", help="profile the same-host hand-off in one copy")
    args = parser.parse_args()
    mode = "borrow" if args.borrow else "shm" if args.shm else "socket"
    phases = {"borrow": BORROW_PHASES, "shm": SHM_PHASES, "socket": PHASES}[mode]
    model_dir = bench.prepare_model(None)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    out = Path("/tmp") / f"kv_pull_profile_{time.time_ns()}.json"
    proc = ctx.Process(target=prefill_entry, args=(theirs, str(model_dir), args.tokens, 1, str(out)), daemon=True)
    proc.start()
    theirs.close()  # ours only: a prefill process that dies ends our recv (EOFError) instead of hanging it
    try:
        info = ours.recv()
        patch_client()
        stamped, copies = asyncio.run(pull_all(info, args.tokens, args.repeats, mode))
        ours.send("stop")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    stamps = [tuple(s) for s in json.loads(out.read_text())] + STAMPS
    out.unlink()
    table = summarize(stamps, stamped, args.tokens, args.repeats, phases)  # type: ignore[arg-type]
    print("| phase | " + " | ".join(f"{n} tokens" for n in args.tokens) + " |")
    print("| --- | " + " | ".join("---:" for _ in args.tokens) + " |")
    for _, _, what in phases:
        print(f"| {what} | " + " | ".join(f"{table[n][what]:.2f} ms" for n in args.tokens) + " |")
    if mode == "borrow":
        print(
            "| plain copy of as many bytes, this process | "
            + " | ".join(f"{copies[n]:.2f} ms" for n in args.tokens)
            + " |"
        )


if __name__ == "__main__":
    main()
