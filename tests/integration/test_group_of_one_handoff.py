"""A TP 2 prefill group and a single decode worker on one host hand off through the same code as two single
workers: the prefill side's `PrefillKv` and the decode side's `DecodeKv` (what the workers run), built from one
`KvTransferSettings`, over real processes (the group's follower rank is spawned), gRPC, and the same-host path
(each pull asked over the prefill rank's Unix socket, its bytes through the pair's shared segment).

For a prefill worker of one rank and a group of two, the same scenario: the pulled KV equals the single-process
engine's export and the decode engine continues it token for token; the same-host path is taken and counted
(`pdserve:kv_local_pulls_total`); the prefill side frees the KV once pulled and its block manager checks out; and
the fault injection of the settings (`fault_send_stall_s`) reaches every prefill rank: a pull of only that rank's
KV heads, made as a decode group's rank would, takes at least the stall.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.sampling import SamplingParams
from shared.kv.decode_kv import DecodeKv
from shared.kv.endpoints import kv_client, rank_worker_id
from shared.kv.held import Freed
from shared.kv.prefill_kv import PrefillKv
from shared.kv.rank_transfer import pull_rank_kv
from shared.kv.registry import KvLocation
from shared.kv.reslice import group_record
from shared.parallel.group_engine import WorkerGroup, start_group
from shared.settings import KvTransferSettings
from shared.worker.kv_ranks import kv_ranks
from tests.kv_locations import Registry

pytestmark = pytest.mark.slow  # a worker group: its follower rank is spawned (make test-slow)

SECRET = "group-of-one-secret-0123456789"
MODEL_NAME = "demo"
STALL_S = 0.6
SETTINGS = KvTransferSettings(fault_send_stall_s=STALL_S, lease_s=60.0, timeout_s=30.0)
PROMPT = torch.randint(5, 200, (29,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _config(model_dir, **kw) -> EngineConfig:
    base: dict[str, Any] = dict(
        model=str(model_dir),
        block_size=4,
        num_kv_blocks=48,
        max_model_len=64,
        threads=1,
        prepack_weights=False,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
    )
    return EngineConfig(**(base | kw))


def _inline(engine: Engine) -> Callable[[Callable[[Engine], Any]], Any]:
    async def call(fn: Callable[[Engine], Any]) -> Any:
        return fn(engine)

    return call


def _run(engine: Engine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
    return tokens


def _prefill(engine: Engine, key: str) -> int:
    """The prompt to its first token, its KV kept for a pull; → the first token."""
    engine.add_request(key, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    return _run(engine)[0]


def _local_pulls() -> float:
    labels = {"model_name": MODEL_NAME, "role": "decode"}
    return REGISTRY.get_sample_value("pdserve:kv_local_pulls_total", labels) or 0.0


async def _hand_off(
    engine: Engine, group: WorkerGroup | None, tp: int, decoder: Engine, sent: KVExport, expected: list[int]
) -> None:
    """The prefill worker's hand-off over `engine` (its ranks: `tp`, led as `group`), the decode worker's into
    `decoder`."""
    registry = Registry()
    prefill = PrefillKv(SETTINGS, engine, _inline(engine), registry, secret=SECRET, model_name=MODEL_NAME,
                        ranks=kv_ranks(group))  # fmt: skip
    address = await prefill.start()
    decode = DecodeKv(SETTINGS, "decode-1", decoder.layout, secret=SECRET, model_name=MODEL_NAME)
    await decode.start()
    try:
        first = _prefill(engine, "k")
        loc = KvLocation("k", "prefill-1", address, len(PROMPT), prefill.layout.fingerprint)
        assert await prefill.hold("k", "k", 0, loc)
        loc = registry.entries["k"]
        assert (loc.group is None) == (tp == 1)  # a group's location carries its record

        before = _local_pulls()
        pulled = await decode.pull("k", loc)
        assert pulled.failure is None and pulled.kv is not None
        assert pulled.kv.num_tokens == sent.num_tokens and pulled.kv.blocks.shape == sent.blocks.shape
        # a group's ranks compute their heads' K/V apart (float sums in another order): equal to rounding
        assert torch.allclose(pulled.kv.blocks, sent.blocks, rtol=1e-4, atol=1e-5)
        assert decode.client is not None and decode.client.stats.shm_pulls == tp  # one per prefill rank
        assert _local_pulls() - before == tp  # asked over each rank's Unix socket: the same-host path, counted

        decoder.import_kv("d", PROMPT, [first], GREEDY, pulled.kv)
        decode.recycle(pulled.kv)
        assert [first, *_run(decoder)] == expected  # the decode engine continues the pulled KV token for token
        decoder.check_integrity()

        await _until_freed(prefill, registry)  # the last send's end reaches the leader, which frees on every rank
        assert prefill.held.freed == {Freed.PULLED: 1} and not registry.entries
        await _stall_reaches_every_rank(prefill, engine, tp, address)
        await _until_freed(prefill, registry)
        engine.check_integrity()
    finally:
        await decode.close()
        await prefill.close()


async def _stall_reaches_every_rank(prefill: PrefillKv, engine: Engine, tp: int, address: str) -> None:
    """Each prefill rank's server stalls its sends: a pull of only rank r's KV heads (decode rank r of a TP = tp
    group) takes at least the stall."""
    model = dataclasses.replace(prefill.layout, kv_heads=())
    record = prefill.record or group_record(model, 1, [address])
    for rank in range(tp):
        key = f"probe{rank}"
        _prefill(engine, key)
        assert await prefill.hold(key, key, 0, KvLocation(key, "prefill-1", address, len(PROMPT), model.fingerprint))
        client = kv_client(SETTINGS, rank_worker_id("probe-g", rank), secret=SECRET, model_name="probe",
                           group_id="probe-g")  # fmt: skip
        try:
            started = time.perf_counter()
            kv = await pull_rank_kv(client, record, key, model, tp, rank)
            assert time.perf_counter() - started >= STALL_S, f"rank {rank}'s sends did not stall"
            assert kv.num_tokens == len(PROMPT)
        finally:
            await client.close()
        await prefill.release(key)  # a send still ending: freed when it ends


async def _until_freed(prefill: PrefillKv, registry: Registry) -> None:
    """Until no record is left and the last free deleted its entry (it retires the key on every rank first)."""
    for _ in range(500):
        if not prefill.count() and not registry.entries:
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("tp", [1, 2], ids=["prefill-of-one", "prefill-group-of-two"])
def test_prefill_group_and_single_decode_hand_off_on_one_host(model_dir, tp: int) -> None:
    single = Engine.build(_config(model_dir))  # the single-process reference: its export and its greedy tokens
    first = _prefill(single, "r")
    sent = single.export_kv("r")
    whole = Engine.build(_config(model_dir))
    whole.add_request("w", PROMPT, GREEDY)
    expected = _run(whole)
    assert expected[0] == first
    decoder = Engine.build(_config(model_dir))  # the single decode worker's engine
    if tp == 1:
        engine = Engine.build(_config(model_dir, kv_shared_memory=True))  # a single prefill worker's pool is shared
        asyncio.run(_hand_off(engine, None, tp, decoder, sent, expected))
        return
    group = start_group(_config(model_dir, tp=2))
    try:
        asyncio.run(_hand_off(group.engine, group, tp, decoder, sent, expected))
    finally:
        group.close()
