"""Heartbeats: what a worker tells the gateway every HEARTBEAT_S (liveness, load, KV held, integrity), built
from the engine-load snapshot; and the facts only the engine thread can gather for them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.aio.client import Client as NATS

from shared.engine.engine import Engine
from shared.messages import Heartbeat, HotExperts, PathCalibration, Role, encode
from shared.model.expert_parallel import RankLoad
from shared.model.expert_shards import take_rank_load
from shared.worker.block_announcer import BlockAnnouncer
from shared.worker.engine_load import EngineLoad

HEARTBEAT_S = 1.0


def build_heartbeat(
    load: EngineLoad,
    *,
    worker_id: str,
    role: Role,
    model: str,
    rpc_address: str | None,
    held_kv: int,
    integrity_error: str | None,
    draining: bool,
    switching_to: Role | None = None,
    parallel: str = "",
    rank_pids: tuple[int, ...] = (),
    path_calibration: PathCalibration | None = None,
    blocks: BlockAnnouncer | None = None,
    hot_experts: HotExperts | None = None,
) -> Heartbeat:
    """blocks: the worker's prefix-cache announcer, if any: its incarnation and last update number go along."""
    return Heartbeat(
        worker_id=worker_id,
        role=role,
        model=model,
        rpc_address=rpc_address,
        running=load.running,
        waiting=load.waiting,
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
        prefill_tokens=load.prefill_tokens,
        decode_tokens=load.decode_tokens,
        held_kv=held_kv,
        integrity_error=integrity_error,
        block_size=load.block_size,
        draining=draining,
        switching_to=switching_to,
        parallel=parallel,
        rank_pids=rank_pids,
        kv_group_free_blocks=load.group_free_blocks,
        kv_group_total_blocks=load.group_total_blocks,
        path_calibration=path_calibration,
        waiting_tokens=load.waiting_tokens,
        kv_blocks_epoch=blocks.epoch if blocks is not None else "",
        kv_blocks_seq=blocks.seq if blocks is not None else 0,
        hot_experts=hot_experts,
        dp_rank_running=load.dp_running,
        dp_rank_free_blocks=load.dp_free_blocks,
    )


async def publish_heartbeats(nc: NATS, subject: str, beat: Callable[[], Heartbeat]) -> None:
    """Publish `beat()` on `subject` every HEARTBEAT_S, forever; a beat NATS cannot take is skipped."""
    while True:
        with contextlib.suppress(Exception):
            await nc.publish(subject, encode(beat()))
        await asyncio.sleep(HEARTBEAT_S)


def _integrity_error(engine: Engine) -> str | None:
    try:
        engine.check_integrity()
    except AssertionError as exc:
        return str(exc) or "integrity check failed"
    return None


def beat_facts(engine: Engine) -> tuple[str | None, dict[int, list[int]], RankLoad | None]:
    """On the engine thread: the integrity verdict, the expert load routed since the last beat, and with
    expert parallelism the per-rank load (both counted on the device in the steps, read here once). The
    router runs replicated on every rank, so the leader's counters are the whole group's."""
    load = {layer: counts.tolist() for layer, counts in engine.model.take_expert_load().items()}
    return _integrity_error(engine), load, take_rank_load(engine.model)
