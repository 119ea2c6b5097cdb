"""KV handed off rank to rank between groups of different TP, across real processes and gRPC ports.

Each prefill rank is a spawned process owning a KVPool slice (its `kv_head_range`) of a real engine's KV (its
RankKv) and a KvTransferServer; this process plays the prefill leader (KvHandOff, talking to the ranks over pipes,
as the groups runtime's agents would) and every decode rank (one KvTransferClient each, its own transfer id). What the
decode ranks assemble must be byte-identical to the single-rank engine's export of the same prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest
import torch

from services.demo_model import _write_weights, random_weights, write_demo_checkpoint
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.sampling import SamplingParams
from shared.kv.endpoints import kv_server, rank_worker_id
from shared.kv.held import Freed, KvHandOff
from shared.kv.rank_held import HeldTable, RankKv, SendOutcome
from shared.kv.rank_transfer import pull_rank_kv
from shared.kv.reslice import group_record
from shared.kv.transfer import FailureReason, KvTransferClient, KvTransferError
from shared.settings import KvTransferSettings
from shared.sharding.layout import kv_head_range

pytestmark = pytest.mark.slow  # worker groups: ranks spawned per scenario (make test-slow)

SECRET = b"test-cluster-secret-0123456789"
TIMEOUT_S = 20.0
POOL_BLOCKS = 16


def _rank_main(conn: Connection, reports: mp.Queue, rank: int, layout: KVLayout, tensor: torch.Tensor) -> None:
    asyncio.run(_rank_serve(conn, reports, rank, layout, tensor))


async def _rank_serve(conn: Connection, reports: mp.Queue, rank: int, layout: KVLayout, tensor: torch.Tensor) -> None:
    """One prefill rank: serve pulls of its pool; run the leader's commands (hold, retire, state, stop)."""
    pool = KVPool(layout, POOL_BLOCKS)
    pool.tensor.copy_(tensor)

    class Reports:  # the rank's reports reach the leader through the queue
        async def send_began(self, key: str, rank: int) -> None:
            reports.put(("began", key, rank))

        async def send_ended(self, key: str, rank: int, outcome: SendOutcome, group_pulls: int) -> None:
            reports.put(("ended", key, rank, outcome.value, group_pulls))

    held = RankKv(rank, Reports(), pool=pool)
    server = kv_server(KvTransferSettings(), held, secret=SECRET.decode(), model_name="", port=0)
    conn.send(await server.start())
    try:
        while True:
            op, *args = await asyncio.to_thread(conn.recv)
            if op == "stop":
                break
            if op == "hold":
                conn.send(await held.hold(*args))
            elif op == "close":
                conn.send(await held.close(*args))
            elif op == "retire":
                conn.send(await held.retire(*args))
            elif op == "state":
                conn.send(dict(held=held.held(), **vars(server.stats)))
    finally:
        await server.stop()


@dataclasses.dataclass
class RankProcess:
    """The leader's link to one prefill rank (a RankLink over a pipe)."""

    proc: BaseProcess
    conn: Connection
    address: str
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def call(self, *command):
        with self.lock:
            self.conn.send(command)
            return self.conn.recv()

    async def hold(self, key: str, table: HeldTable | None = None) -> None:
        await asyncio.to_thread(self.call, "hold", key, table)

    async def close(self, key: str, stop_why: str | None = None) -> None:
        await asyncio.to_thread(self.call, "close", key, stop_why)

    async def retire(self, key: str, wait: bool = True) -> None:
        await asyncio.to_thread(self.call, "retire", key, wait)


def _checkpoint(tmp_path, kv_heads: int) -> str:
    path = write_demo_checkpoint(tmp_path / f"kvh{kv_heads}")
    cfg = json.loads((path / "config.json").read_text()) | {"num_key_value_heads": kv_heads}
    (path / "config.json").write_text(json.dumps(cfg))
    _write_weights(path, random_weights(cfg, 0), None)
    return str(path)


def _single_rank_export(checkpoint: str, prompt_len: int) -> KVExport:
    engine = Engine.build(
        EngineConfig(
            model=checkpoint, num_kv_blocks=48, max_model_len=512, scheduler=SchedulerConfig(max_num_batched_tokens=128)
        )
    )
    prompt = torch.randint(0, 259, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    return engine.export_kv("r")


class PrefillGroup:
    """tp spawned rank processes, each with its slice of `full` in blocks placed at `block_ids`."""

    def __init__(self, full: KVExport, tp: int) -> None:
        ctx = mp.get_context("spawn")
        self.layout = full.layout
        self.reports = ctx.Queue()
        n = full.blocks.shape[2]
        self.block_ids = [POOL_BLOCKS - 1 - 2 * i for i in range(n)]  # scattered, descending: the index matters
        self.ranks: list[RankProcess] = []
        for rank in range(tp):
            heads = kv_head_range(self.layout.num_kv_heads, tp, rank)
            layout = dataclasses.replace(self.layout, kv_heads=tuple(heads))
            tensor = torch.zeros(
                KVPool(layout, 1).tensor.shape[:2] + (POOL_BLOCKS,) + KVPool(layout, 1).tensor.shape[3:]
            )
            tensor[:, :, self.block_ids] = full.blocks[:, :, :, :, heads.start : heads.stop]
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(theirs, self.reports, rank, layout, tensor), daemon=True)
            proc.start()
            self.ranks.append(RankProcess(proc, ours, ours.recv()))
        self.released: list[str] = []
        self.record = group_record(self.layout, tp, [r.address for r in self.ranks])

    async def _release(self, key: str) -> None:
        self.released.append(key)

    def leader(self) -> KvHandOff:
        return KvHandOff(self.ranks, self._release, lease_s=600.0)

    async def forward_reports(self, leader: KvHandOff) -> None:
        while (report := await asyncio.to_thread(self.reports.get)) is not None:  # None: stop
            if report[0] == "began":
                await leader.send_began(*report[1:])
            else:
                key, rank, outcome, pulls = report[1:]
                await leader.send_ended(key, rank, SendOutcome(outcome), pulls)

    def stop(self) -> None:
        for r in self.ranks:
            r.conn.send(("stop",))
            r.proc.join(10)


def _clients(dst_tp: int, group: str = "decode-g") -> list[KvTransferClient]:
    return [
        KvTransferClient(rank_worker_id("decode-g", j), secret=SECRET, timeout_s=TIMEOUT_S, group_id=group)
        for j in range(dst_tp)
    ]


async def _hand_off(group: PrefillGroup, full: KVExport, dst_tp: int, refusals: bool) -> None:
    leader = group.leader()
    forwarding = asyncio.create_task(group.forward_reports(leader))
    clients = _clients(dst_tp)
    try:
        assert await leader.hold("r", "r", 0, table=HeldTable(group.block_ids, full.num_tokens))
        if refusals:
            await _check_refusals(group, full.layout)
        pulled = await asyncio.gather(
            *(pull_rank_kv(c, group.record, "r", full.layout, dst_tp, j) for j, c in enumerate(clients))
        )
        for j, kv in enumerate(pulled):
            heads = kv_head_range(full.layout.num_kv_heads, dst_tp, j)
            assert kv.layout.kv_heads == tuple(heads) and kv.num_tokens == full.num_tokens
            assert torch.equal(kv.blocks, full.blocks[:, :, :, :, heads.start : heads.stop])  # byte-identical
        for _ in range(100):  # the last report reaches the leader, which frees once every send ended
            if group.released:
                break
            await asyncio.sleep(0.05)
        assert group.released == ["r"] and leader.freed == {Freed.PULLED: 1}
        assert all(r.call("state")["held"] == [] for r in group.ranks)
    finally:
        group.reports.put(None)  # ends the forwarding thread's get (asyncio.run waits for its executor)
        await asyncio.wait_for(forwarding, TIMEOUT_S)
        for c in clients:
            await c.close()


async def _check_refusals(group: PrefillGroup, layout: KVLayout) -> None:
    """Another decode group's ticket is refused at every rank; another model's KV is INCOMPATIBLE (both the
    record check on the decode side and the server's fingerprint check); the KV stays held throughout."""
    other = KvTransferClient(rank_worker_id("decode-g", 0), secret=SECRET, timeout_s=TIMEOUT_S, group_id="other-g")
    try:
        for rank in group.record.ranks:
            heads = range(rank.kv_heads[0], rank.kv_heads[0] + 1)
            with pytest.raises(KvTransferError) as refused:
                await other.pull(rank.rpc_address, "r", dataclasses.replace(layout, kv_heads=tuple(heads)), 1)
            assert refused.value.reason is FailureReason.DENIED and "wrong_worker" in str(refused.value)
        wider = dataclasses.replace(layout, head_dim=layout.head_dim * 2)
        with pytest.raises(KvTransferError, match="head dim 16 \\(prefill\\) vs 32") as incompatible:
            await pull_rank_kv(other, group.record, "r", wider, 1, 0)
        assert incompatible.value.reason is FailureReason.INCOMPATIBLE
        ours = _clients(1)[0]  # the right group: what refuses it is the prefill rank's fingerprint check
        with pytest.raises(KvTransferError, match="FAILED_PRECONDITION") as fingerprint:
            await ours.pull(group.record.ranks[0].rpc_address, "r", dataclasses.replace(wider, kv_heads=(0,)), 1)
        assert fingerprint.value.reason is FailureReason.INCOMPATIBLE
        await ours.close()
    finally:
        await other.close()
    assert all(r.call("state")["held"] == ["r"] for r in group.ranks)


@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_hand_off_between_layouts_is_byte_identical(tmp_path, kv_heads: int, src_tp: int, dst_tp: int) -> None:
    full = _single_rank_export(_checkpoint(tmp_path, kv_heads), prompt_len=37)
    assert full.layout.num_kv_heads == kv_heads
    group = PrefillGroup(full, src_tp)
    try:
        asyncio.run(_hand_off(group, full, dst_tp, refusals=src_tp == 2 and kv_heads == 2))
    finally:
        group.stop()
