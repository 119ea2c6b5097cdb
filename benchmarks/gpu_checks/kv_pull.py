"""Check 3: a KV pull between two processes over the transfer plane (shared/kv/transfer), bytes identical, and
its GB/s against a raw send/recv of the same bytes on a second pair between the same processes (the raw gloo
comparison of benchmarks/kv_transfer_bench.py, on the pull's backend).

A spawned prefill process prefills one prompt REPEATS + 1 times with hold_kv (the same prompt, so the same KV
bytes each time), holds each in a HeldKv as a prefill worker does, and serves KvTransfer; this process pulls
each once. Backend: NCCL between cuda:0 and cuda:1 with two GPUs. NCCL refuses two ranks of one communicator
on one GPU ("Duplicate GPU detected", NVIDIA/nccl#418), so with one GPU the pull goes over gloo from and to
that GPU's engines, and the details say so; under --allow-cpu, gloo on CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu_checks.common import CheckResult, Target, sync, verdict
from services.demo_model import write_demo_checkpoint
from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.transfer import EngineKvBlocks, KvTransferClient, KvTransferServer
from shared.kv.transfer.pair import DECODE_RANK, PREFILL_RANK, Pair, TransferBackend
from shared.kv.transfer.send_stream import SendStream

# torch.distributed re-exports its C++ TCPStore without marking it public (as in shared/kv/transfer/pair.py)
# pyright: reportPrivateImportUsage=false

NAME = "kv_pull"
HOST = "127.0.0.1"
SECRET = b"gpu-check-kv-pull-secret"
TIMEOUT_S = 30.0
GO_TAG = 1  # raw pair: the "go" message; the payload answers with GO_TAG + 1


def plan(target: Target) -> tuple[TransferBackend, str, str]:
    """(backend, prefill device, decode device)."""
    if target.two_gpus:
        return TransferBackend.NCCL, "cuda:0", "cuda:1"
    return TransferBackend.GLOO, target.device(), target.device()


def check(target: Target) -> CheckResult:
    backend, src_dev, dst_dev = plan(target)
    size, tokens, repeats = ("tiny", 64, 3) if target.cpu else ("small", 4096, 9)
    ckpt = write_demo_checkpoint(Path(target.work_dir) / f"kv-{size}", size=size)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    args = (theirs, str(ckpt), backend, src_dev, tokens, repeats + 1)
    proc = ctx.Process(target=_prefill_main, args=args, daemon=True)
    proc.start()
    try:
        if not ours.poll(TIMEOUT_S * 2):
            raise RuntimeError(f"the prefill process did not start (exit code {proc.exitcode})")
        info = ours.recv()
        # gloo carries CPU tensors: the server sends a host copy and a decode worker receives into host memory
        recv_dev = dst_dev if backend is TransferBackend.NCCL else "cpu"
        numbers, failures = asyncio.run(_measure(info, backend, recv_dev, repeats))
        ours.send("stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    details = f"{backend} from {src_dev} to {dst_dev}, {size} demo model, {tokens} prompt tokens, median of {repeats}"
    if not target.cpu and not target.two_gpus:
        details += "; not NCCL: NCCL refuses two ranks on one GPU (needs two GPUs)"
    return verdict(NAME, failures, numbers | dict(backend=str(backend)), details)


# ---- the prefill process ------------------------------------------------------------------------------------


def _prefill_main(conn: Connection, ckpt: str, backend: TransferBackend, device: str, tokens: int, n: int) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    engine = Engine.from_dir(ckpt, device=device, num_kv_blocks=n * (-(-tokens // 16) + 1), max_model_len=tokens + 16)
    prompt = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    for i in range(n):
        engine.add_request(f"kv-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    payload = engine.export_kv("kv-0").blocks  # a copy: the bytes every pull must deliver
    payload = (payload if backend is TransferBackend.NCCL else payload.cpu()).contiguous()  # gloo: host memory
    asyncio.run(_serve(conn, engine, backend, payload, n))


async def _serve(conn: Connection, engine: Engine, backend: TransferBackend, payload: torch.Tensor, n: int) -> None:
    stream = SendStream(engine.device)  # as the prefill worker: exports and sends off the compute stream
    source = HeldKv(EngineKvBlocks(engine, send_stream=stream), lease_s=600.0)
    for i in range(n):
        await source.hold(f"kv-{i}", f"kv-{i}", 0)
    server = KvTransferServer(HOST, 0, source, secret=SECRET, timeout_s=TIMEOUT_S, backend=backend,
                              send_stream=stream)  # fmt: skip
    address = await server.start()
    raw_store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    conn.send(dict(address=address, raw_port=raw_store.port, layout=dataclasses.asdict(engine.layout), n=n))
    raw = threading.Thread(target=_raw_sender, args=(raw_store, backend, payload), daemon=True)
    raw.start()
    await asyncio.to_thread(conn.recv)  # "stop"
    await server.stop()


def _raw_sender(store: dist.TCPStore, backend: TransferBackend, payload: torch.Tensor) -> None:
    """Answer each "go" with the payload, until a go of -1."""
    pair = Pair.join(backend, store, "raw", PREFILL_RANK, TIMEOUT_S, HOST if backend is TransferBackend.GLOO else None)
    go = torch.zeros(1, dtype=torch.int64, device=payload.device)
    while True:
        pair.recv([go], GO_TAG)
        if int(go[0]) < 0:
            return
        pair.send([payload], GO_TAG + 1)


# ---- this process: the decode side ----------------------------------------------------------------------------


async def _measure(info: dict, backend: TransferBackend, device: str, repeats: int) -> tuple[dict, list[str]]:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    layout = KVLayout(**info["layout"])
    client = KvTransferClient("gpu-check-decode", secret=SECRET, timeout_s=TIMEOUT_S, backend=backend, device=device)
    store = dist.TCPStore(HOST, info["raw_port"], is_master=False)
    local = HOST if backend is TransferBackend.GLOO else None
    raw = await asyncio.to_thread(Pair.join, backend, store, "raw", DECODE_RANK, TIMEOUT_S, local)
    pulled, pull_s, raw_s = [], [], []
    raw_buffer = torch.empty(0)  # sized by the first pull
    try:
        for i in range(info["n"]):  # the first of each is a warm-up (pair set-up, allocation)
            t0 = time.perf_counter()
            kv = await client.pull(info["address"], f"kv-{i}", layout)
            sync(device)
            pull_s.append(time.perf_counter() - t0)
            pulled.append(kv.blocks)
            if i == 0:
                raw_buffer = torch.empty_like(kv.blocks)
            raw_s.append(await asyncio.to_thread(_raw_pull, raw, raw_buffer, device))
        await asyncio.to_thread(raw.send, [torch.tensor([-1], device=raw_buffer.device)], GO_TAG)
    finally:
        await client.close()
    identical = sum(torch.equal(blocks, raw_buffer) for blocks in pulled)
    nbytes = raw_buffer.numel() * raw_buffer.element_size()
    pull, raw_med = statistics.median(pull_s[1:]), statistics.median(raw_s[1:])
    numbers = dict(bytes=nbytes, pulls=len(pulled), identical=identical, pull_ms=pull * 1e3,
                   raw_ms=raw_med * 1e3, pull_gbps=nbytes / pull / 1e9, raw_gbps=nbytes / raw_med / 1e9,
                   pull_vs_raw=raw_med / pull)  # fmt: skip
    failures = [] if identical == len(pulled) else [f"{len(pulled) - identical} of {len(pulled)} pulls differ"]
    return numbers, failures


def _raw_pull(pair: Pair, out: torch.Tensor, device: str) -> float:
    t0 = time.perf_counter()
    pair.send([torch.zeros(1, dtype=torch.int64, device=out.device)], GO_TAG)
    pair.recv([out], GO_TAG + 1)
    sync(device)
    return time.perf_counter() - t0
