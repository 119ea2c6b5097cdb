"""KV hand-off between worker groups: prefill TP 2 → decode TP 1 against TP 1 → TP 1, in one run, and its
share of the TTFT (the same prompt's prefill, measured in the same run).

    .venv/bin/python benchmarks/kv_reslice_bench.py [--tokens 4096] [--repeats 9] [--prefill-repeats 2]
        [--threads 2] [--model DIR] [--out JSON]

The KV is that of a `tokens`-token prompt of the `small` demo model's layout (8 layers, 2 KV heads, head dim 64,
float32: 33.6 MB at 4k tokens), random values (the bytes' values do not change the cost). Each prefill rank is a
spawned process with its slice of the pool (`kv_head_range`) and its own KvTransferServer (a `RankKv` over its
pool slice, served by `kv_server`); this process is the decode rank (`pull_rank_kv`: the plan's pulls from every
source rank at once, assembled into one tensor of its heads) and plays the prefill leader (`KvHandOff`: holds
the key on every rank before a pull, frees it once the group's pulls ended). Timed: `pull_rank_kv`, from the
call to the assembled tensor, after one warm-up that forms the pairs; medians of `repeats`; the layouts
alternate.

TTFT: the prefill of one `tokens`-token prompt to its first token on the `small` demo checkpoint (the model
whose KV layout the hand-off moves), TP 1 with --threads threads in this process, and TP 2 with half as many per
rank (`run_on_ranks`: this process and one spawned rank; the slower rank counts); after a short warm-up;
medians of --prefill-repeats. The share reported is hand-off / TTFT of the same prefill TP. In pdserve the
hand-off follows the first token (prefill publishes it, then decode pulls), so it delays the second token: the
share says how much a pull adds to the start of a stream, not a part of TTFT itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from benchmarks.host_info import cpu_info  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_pool import KVLayout, KVPool  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.kv.endpoints import kv_server, rank_worker_id  # noqa: E402
from shared.kv.held import KvHandOff  # noqa: E402
from shared.kv.rank_held import HeldTable, RankKv, SendOutcome  # noqa: E402
from shared.kv.rank_transfer import pull_rank_kv  # noqa: E402
from shared.kv.reslice import group_record  # noqa: E402
from shared.kv.transfer import KvTransferClient  # noqa: E402
from shared.parallel.launch import run_on_ranks  # noqa: E402
from shared.settings import KvTransferSettings  # noqa: E402
from shared.sharding.group import RankGroup  # noqa: E402
from shared.sharding.layout import kv_head_range  # noqa: E402

SECRET = b"kv-reslice-bench-secret-0123"
TIMEOUT_S = 120.0
MODEL = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")


def _rank_main(conn: Connection, reports: mp.Queue, rank: int, layout: KVLayout, blocks: int) -> None:
    async def serve() -> None:
        pool = KVPool(layout, blocks)
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(rank)))

        held = RankKv(rank, _Reports(reports), pool=pool)
        server = kv_server(KvTransferSettings(), held, secret=SECRET.decode(), model_name="", port=0)
        conn.send(await server.start())
        while (command := await asyncio.to_thread(conn.recv))[0] != "stop":
            op, *args = command
            conn.send(await getattr(held, op)(*args))  # hold, close or retire
        await server.stop()

    asyncio.run(serve())


class _Reports:
    """A rank's send reports, to the leader through the queue."""

    def __init__(self, queue: mp.Queue) -> None:
        self.queue = queue

    async def send_began(self, key: str, rank: int) -> None:
        self.queue.put(("began", key, rank))

    async def send_ended(self, key: str, rank: int, outcome: SendOutcome, group_pulls: int) -> None:
        self.queue.put(("ended", key, rank, outcome.value, group_pulls))


class Group:
    def __init__(self, tp: int, blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.reports = ctx.Queue()
        self.links = []
        for rank in range(tp):
            layout = dataclasses.replace(MODEL, kv_heads=tuple(kv_head_range(MODEL.num_kv_heads, tp, rank)))
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(theirs, self.reports, rank, layout, blocks), daemon=True)
            proc.start()
            self.links.append(_Link(proc, ours, ours.recv()))
        self.record = group_record(MODEL, tp, [link.address for link in self.links])

    def stop(self) -> None:
        for link in self.links:
            link.conn.send(("stop",))
            link.proc.join(10)


@dataclasses.dataclass
class _Link:
    proc: BaseProcess
    conn: Connection
    address: str

    async def hold(self, key: str, table: HeldTable | None = None) -> None:
        await asyncio.to_thread(self._call, "hold", key, table)

    async def close(self, key: str, stop_why: str | None = None) -> None:
        await asyncio.to_thread(self._call, "close", key, stop_why)

    async def retire(self, key: str, wait: bool = True) -> None:
        await asyncio.to_thread(self._call, "retire", key, wait)

    def _call(self, *command):
        self.conn.send(command)
        return self.conn.recv()


async def _bench(groups: dict[str, Group], tokens: int, repeats: int) -> dict[str, dict]:
    blocks = -(-tokens // MODEL.block_size)
    out: dict[str, dict] = {}
    leaders, forwards, clients, times = {}, {}, {}, {name: [] for name in groups}
    for name, group in groups.items():
        leaders[name] = leader = KvHandOff(group.links, _noop, lease_s=600.0)
        forwards[name] = asyncio.create_task(_forward(group, leader))
        clients[name] = KvTransferClient(
            rank_worker_id(f"bench-{name}", 0), secret=SECRET, timeout_s=TIMEOUT_S, group_id=f"bench-{name}"
        )
    for i in range(repeats + 1):  # the first round forms the pairs: not timed
        for name, group in groups.items():
            key = f"{name}-{i}"
            await leaders[name].hold(key, key, 0, table=HeldTable(list(range(blocks)), tokens))
            started = time.perf_counter()
            kv = await pull_rank_kv(clients[name], group.record, key, MODEL, 1, 0)
            elapsed = time.perf_counter() - started
            if i:
                times[name].append(elapsed)
            out[name] = {"bytes": kv.nbytes, "pulls_per_request": len(group.record.ranks)}
            while leaders[name].count():  # freed once the group's pulls ended: the next key starts clean
                await asyncio.sleep(0.001)
    for name, group in groups.items():
        group.reports.put(None)
        await forwards[name]
        await clients[name].close()
        t = times[name]
        out[name] |= {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)}
        out[name]["gbytes_per_s"] = out[name]["bytes"] / statistics.median(t) / 1e9
    return out


async def _noop(key: str) -> None:
    return None


async def _forward(group: Group, leader: KvHandOff) -> None:
    while (report := await asyncio.to_thread(group.reports.get)) is not None:
        if report[0] == "began":
            await leader.send_began(*report[1:])
        else:
            key, rank, outcome, pulls = report[1:]
            await leader.send_ended(key, rank, SendOutcome(outcome), pulls)


def prefill_s(group: RankGroup | None, model: str, threads: int, tokens: int) -> float:
    """Seconds from a `tokens`-token prompt's add to its first token, in one step (this rank's engine)."""
    config = EngineConfig(
        model=model,
        tp=group.world if group else 1,
        threads=threads,
        max_model_len=tokens + 8,
        kv_cache_bytes=256 << 20,
        scheduler=SchedulerConfig(max_num_batched_tokens=tokens),
    )
    engine = Engine.build(config, group=group)
    vocab = engine.model.config.vocab_size
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[5 + i % (vocab - 10) for i in range(32)]], first)  # warm-up
    prompt = [(7 * i) % (vocab - 10) + 3 for i in range(tokens)]
    start = time.perf_counter()
    engine.generate([prompt], first)
    return time.perf_counter() - start


def _ttft(model: str, tokens: int, threads: int, repeats: int) -> dict[str, float]:
    """Median prefill seconds of TP 1 (`threads`) and TP 2 (half each), alternating."""
    runs: dict[str, list[float]] = {"tp1": [], "tp2": []}
    for _ in range(repeats):
        runs["tp1"].append(prefill_s(None, model, threads, tokens))
        ranks = run_on_ranks(2, prefill_s, (model, max(threads // 2, 1), tokens), timeout_s=600)
        runs["tp2"].append(max(ranks))
    return {name: statistics.median(times) for name, times in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="TP 1 prefill's threads; each TP 2 rank gets half")
    parser.add_argument("--model", help="checkpoint of the TTFT prefill (default: the small demo, written once)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_reslice.json"))
    args = parser.parse_args()
    model = args.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small"))
    blocks = -(-args.tokens // MODEL.block_size)
    groups = {"p_tp1_to_d_tp1": Group(1, blocks), "p_tp2_to_d_tp1": Group(2, blocks)}
    try:
        results = asyncio.run(_bench(groups, args.tokens, args.repeats))
    finally:
        for group in groups.values():
            group.stop()
    ratio = results["p_tp2_to_d_tp1"]["median_ms"] / results["p_tp1_to_d_tp1"]["median_ms"]
    ttft = _ttft(model, args.tokens, args.threads, args.prefill_repeats)
    for name, prefill_tp in (("p_tp1_to_d_tp1", "tp1"), ("p_tp2_to_d_tp1", "tp2")):
        results[name]["ttft_ms"] = 1e3 * ttft[prefill_tp]  # the prefill group's own TTFT
        results[name]["share_of_ttft"] = results[name]["median_ms"] / results[name]["ttft_ms"]
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_info(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "layout": dataclasses.asdict(MODEL),
        "results": results,
        "tp2_over_tp1_time": ratio,
        "ttft_model": model,
        "ttft_threads": {"tp1": args.threads, "tp2_per_rank": max(args.threads // 2, 1)},
        "prefill_repeats": args.prefill_repeats,
    }
    for name, r in results.items():
        print(
            f"{name}: {r['bytes'] / 1e6:.1f} MB in {r['median_ms']:.1f} ms (median; {r['gbytes_per_s']:.2f} GB/s); "
            f"TTFT {r['ttft_ms']:.0f} ms, hand-off {100 * r['share_of_ttft']:.1f}% of it"
        )
    print(f"TP 2 -> TP 1 takes {ratio:.2f}x the time of TP 1 -> TP 1")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
