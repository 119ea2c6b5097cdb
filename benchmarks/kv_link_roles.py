"""The two processes of `kv_link_bench.py`, each started (inside its network namespace when there is one) as

    python benchmarks/kv_link_roles.py prefill|decode   # one JSON object in on stdin, answers on stdout

- prefill: for every shape (architecture × demo size), loads the checkpoint, times the prefill of one random
  prompt per length (engine alone, whole prompt up to its first token, in chunks of `chunk` tokens); for the
  first shape of each distinct KV layout it keeps the last timed run's KV held. Then serves that KV with one
  `KvTransferServer` per (layout, bind address) and prints {prefill times, servers, digests}; it never frees
  the KV (every pull reads the same blocks again) and stops at "stop" on stdin.
- decode: for each config line (one per transport), a `KvTransferClient` (shared memory on or off) pulls
  each target once to form the pair and check the bytes (blake2b of what arrived against the prefill side's),
  then `repeats` times, timed; prints the medians. A pull is timed from the call to the KV in hand: Pull RPC
  + the source's send plan + the wire.
Logs go to stderr; stdout carries only the JSON answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_pool import KVLayout  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.kv.transfer import KvTransferClient, KvTransferServer  # noqa: E402
from shared.kv.transfer.buffers import BufferPool  # noqa: E402
from shared.kv.transfer.pool_kv import PoolKv  # noqa: E402

SECRET = b"kv-link-bench-secret-0123456789"  # both sides sign and check tickets, as workers do
TIMEOUT_S = 300.0  # a 16k-token KV over a 1 Gb/s link takes seconds; a loaded host adds more


def layout_key(layout: KVLayout) -> str:
    return f"{layout.fingerprint}/{layout.block_size}"


def layout_to_json(layout: KVLayout) -> dict:
    return dataclasses.asdict(layout) | {"kv_heads": list(layout.kv_heads)}


def layout_from_json(doc: dict) -> KVLayout:
    return KVLayout(**(doc | {"kv_heads": tuple(doc["kv_heads"])}))


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


# ---- prefill side -----------------------------------------------------------------------------------------


class HeldForever:
    """KvSource over held requests that never frees them: each pull sends the blocks as a prefill worker does
    (`PoolKv.plan`: straight from the pool, `EngineKvBlocks`' path), and the next repeat sends them again.
    Never "already sending": the server may end a send (`end_send`) just after the puller has its bytes and
    asked again; the blocks are only read, and each send has its own staging buffer."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.buffers = BufferPool(1 << 30, "cpu")
        self.lent: dict[str, list[torch.Tensor]] = {}

    def is_sending(self, request_id: str, /) -> bool:
        return False

    async def begin_send(self, request_id: str, /) -> PoolKv:
        num_tokens, block_ids, first_block = self.engine.kv_blocks(request_id)
        kv = PoolKv.plan(self.engine.pool, num_tokens, block_ids, self.buffers.take, first_block=first_block)
        self.lent.setdefault(request_id, []).append(kv.staging)
        return kv

    async def end_send(self, request_id: str, /, ok: bool) -> None:
        staging = self.lent[request_id].pop()  # the staging buffer back; the blocks stay held for the next repeat
        if staging is not None:
            self.buffers.give_back(staging)


def prefill_once(engine: Engine, rid: str, prompt: list[int], hold: bool) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=hold)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def time_prefills(engine: Engine, name: str, lengths: list[int], repeats: dict[int, int], hold: bool) -> dict:
    """{length: median seconds}; with hold, the last run of each length keeps its KV as `kv-<length>`."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size - 3  # byte tokens only, no specials
    prefill_once(engine, f"{name}-warm", torch.randint(0, vocab, (min(lengths),), generator=gen).tolist(), False)
    out = {}
    for n in lengths:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        times = []
        for i in range(repeats[n]):
            last = i == repeats[n] - 1
            rid = f"kv-{n}" if hold and last else f"{name}-{n}-{i}"
            times.append(prefill_once(engine, rid, prompt, hold and last))
        out[n] = statistics.median(times)
        print(f"prefill {name} {n}: {out[n] * 1e3:.0f} ms ({repeats[n]} runs)", file=sys.stderr, flush=True)
    return out


async def prefill_main(cfg: dict) -> None:
    torch.set_num_threads(cfg["threads"])
    lengths = cfg["lengths"]
    repeats = {n: (cfg["short_repeats"] if n <= cfg["short_max"] else 1) for n in lengths}
    blocks_needed = sum(-(-n // 16) for n in lengths) + 2 * -(-max(lengths) // 16)
    prefill: dict[str, dict[int, float]] = {}
    sources: dict[str, HeldForever] = {}
    layouts: dict[str, str] = {}  # shape → its layout key
    for shape in cfg["shapes"]:
        engine = Engine.from_dir(
            shape["dir"],
            scheduler=SchedulerConfig(max_num_batched_tokens=cfg["chunk"]),
            num_kv_blocks=blocks_needed,
            max_model_len=max(lengths) + 16,
            threads=cfg["threads"],
        )
        key = layout_key(engine.layout)
        layouts[shape["name"]] = key
        hold = key not in sources
        prefill[shape["name"]] = time_prefills(engine, shape["name"], lengths, repeats, hold)
        if hold:
            sources[key] = HeldForever(engine)
        del engine  # a shape whose layout is already held: its engine goes
    servers, answer = [], {"prefill": prefill, "shape_layout": layouts, "layouts": {}}
    for key, source in sources.items():
        entry = answer["layouts"][key] = {"layout": layout_to_json(source.layout), "addresses": {}, "kv": {}}
        for n in lengths:
            kv = source.engine.export_kv(f"kv-{n}")
            entry["kv"][n] = {"rid": f"kv-{n}", "bytes": kv.blocks.numel() * kv.blocks.element_size(),
                              "digest": digest(kv.blocks)}  # fmt: skip
    # The same-host segment of a pair: room for the largest KV of any layout (each pull reserves a region).
    shm = (max(kv["bytes"] for e in answer["layouts"].values() for kv in e["kv"].values()) | (1 << 20) - 1) + 1
    for key, source in sources.items():
        for host in cfg["hosts"]:
            server = KvTransferServer(host, 0, source, secret=SECRET, timeout_s=TIMEOUT_S, shm_bytes=shm + (1 << 20))
            answer["layouts"][key]["addresses"][host] = await server.start()
            servers.append(server)
    print(json.dumps(answer), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "stop"
    for server in servers:
        await server.stop()


# ---- decode side ------------------------------------------------------------------------------------------


async def decode_main(first: dict) -> None:
    """Answer `first`, then every further config line, until "stop" (one process per namespace, not per run)."""
    torch.set_num_threads(first["threads"])
    cfg = first
    while True:
        print(json.dumps({"results": await pull_targets(cfg)}), flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line.strip() or line.strip() == "stop":
            return
        cfg = json.loads(line)


async def pull_targets(cfg: dict) -> list[dict]:
    client = KvTransferClient(
        f"link-bench-{cfg['transport']}", secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=cfg["shared_memory"]
    )
    results = []
    try:
        for target in cfg["targets"]:
            layout = layout_from_json(target["layout"])
            address, rid = target["address"], target["rid"]
            kv = await client.pull(address, rid, layout)  # forms the pair (first target) and checks the bytes
            if digest(kv.blocks) != target["digest"]:
                raise RuntimeError(f"{cfg['transport']}: {rid} arrived with different bytes")
            client.recycle(kv)
            del kv  # a shared-memory view holds its region while it lives: the timed pulls need the room
            shm_before = client.stats.shm_pulls
            times = []
            for _ in range(cfg["repeats"]):
                t0 = time.perf_counter()
                kv = await client.pull(address, rid, layout)
                times.append(time.perf_counter() - t0)
                client.recycle(kv)  # as a decode worker does once imported (a shared-memory view frees its region)
                del kv
            results.append(dict(layout=target["key"], tokens=target["tokens"], bytes=target["bytes"],
                                median_s=statistics.median(times), min_s=min(times),
                                shm_pulls=client.stats.shm_pulls - shm_before, pulls=len(times)))  # fmt: skip
    finally:
        await client.close()
    return results


if __name__ == "__main__":
    role = sys.argv[1]
    config = json.loads(sys.stdin.readline())
    asyncio.run(prefill_main(config) if role == "prefill" else decode_main(config))
