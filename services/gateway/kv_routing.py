"""KV-aware routing of prefill jobs, the gateway's side: where a fresh prompt's job is published.

Two variants behind one interface, chosen once by `prefill_routing(settings)`:
  - SharedQueue (kv_aware_routing off): every job to the shared prefill queue (`pd.jobs.prefill.<model>`);
  - KvRouting: listens to the workers' prefix-cache block updates (`pd.kv.blocks.<model>.*`, kept in step by
    kv_sync.py into kv_index.py), asks for snapshots when out of step (`pd.kv.snapshot.<model>`, answered to
    one inbox of this gateway), and sends a job to the chosen worker's own queue
    (`pd.jobs.prefill.<model>.<worker>`) when kv_router.py picks one; the shared queue otherwise.
Decode workers announce their blocks too (decode-side reuse): `route_decode` names the decode worker whose cache
holds most of a prompt (decode_router.py), for the prefill worker to hand the decode job to its own queue
(`pd.jobs.decode.<model>.<worker>`); None (decode_kv_reuse off, or no worker holds any of it): the shared queue.
A worker that dies (liveness.py) or drains leaves the index at once; routing only ever considers the live,
not draining ones. The NatsBackend marks a routed request as held by its worker until that worker takes it,
so a routed job whose worker dies moves like any other (nats_backend.py `_move`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.gateway.backend import GenerationJob
from services.gateway.decode_router import DecodeCandidate, choose_decode
from services.gateway.kv_index import PrefixIndex
from services.gateway.kv_router import SHARED, Candidate, Route, choose
from services.gateway.kv_sync import IndexSync
from shared.messages import (
    Heartbeat,
    KvSnapshotRequest,
    Role,
    decode_kv_blocks_or_drop,
    encode,
    kv_blocks_wildcard,
    kv_snapshot_subject,
    prefill_subject,
    routed_prefill_subject,
    subject_token,
)
from shared.prefix_hash import block_hash, root_hash
from shared.settings import GatewaySettings
from shared.telemetry import metrics

log = logging.getLogger(__name__)

_TAKES_PREFILL = (Role.PREFILL, Role.MIXED)
_ANNOUNCES = (*_TAKES_PREFILL, Role.DECODE)  # the roles whose prefix-cache blocks the index keeps


class PrefillRouting(Protocol):
    """What NatsBackend asks of prefill routing."""

    async def start(self, nc: NATS) -> None:
        """Subscribe to what it listens to (once connected)."""

    def on_heartbeat(self, beat: Heartbeat) -> None:
        """Every worker heartbeat the gateway receives."""

    async def tick(self, serving: list[Heartbeat], now: float) -> None:
        """Every watchdog round while connected: `serving`, the live and not draining workers of the model."""

    def route(self, job: GenerationJob, serving: list[Heartbeat], queued: Mapping[str, int]) -> Route:
        """Where a fresh prompt's job would go among `serving` if it takes the remote path (`count_route` once
        it does); `queued`: the prompt tokens this gateway routed to each worker and it has not taken yet."""
        ...

    def route_decode(self, job: GenerationJob, serving: list[Heartbeat]) -> str | None:
        """The decode worker whose cache holds most of the prompt, for its decode job (None: the shared queue)."""
        ...


class SharedQueue:
    """kv_aware_routing off: the shared queue for every job, nothing listened to."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.model = settings.served_model_name

    async def start(self, nc: NATS) -> None:
        pass

    def on_heartbeat(self, beat: Heartbeat) -> None:
        pass

    async def tick(self, serving: list[Heartbeat], now: float) -> None:
        pass

    def route(self, job: GenerationJob, serving: list[Heartbeat], queued: Mapping[str, int]) -> Route:
        return SHARED

    def route_decode(self, job: GenerationJob, serving: list[Heartbeat]) -> str | None:
        return None


class KvRouting:
    def __init__(self, settings: GatewaySettings) -> None:
        self.model = settings.served_model_name
        self.max_queued_tokens = settings.kv_routing_max_queued_tokens
        self.decode_kv_reuse = settings.decode_kv_reuse
        self.index = PrefixIndex()
        self.sync = IndexSync(self.index)
        self._nc: NATS | None = None
        self._inbox = ""  # where this gateway's snapshots come back

    async def start(self, nc: NATS) -> None:
        self._inbox = nc.new_inbox()
        await nc.subscribe(kv_blocks_wildcard(self.model), cb=self._on_blocks)
        await nc.subscribe(self._inbox, cb=self._on_blocks)
        self._nc = nc

    async def _on_blocks(self, msg: Msg) -> None:
        update = decode_kv_blocks_or_drop(msg.data, msg.subject)
        if update is not None:
            self.sync.on_update(update)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.role not in _ANNOUNCES or subject_token(beat.model) != subject_token(self.model):
            return
        if beat.draining:
            self.sync.drop(beat.worker_id)  # takes nothing new: out of the index at once
        else:
            self.sync.on_heartbeat(beat.worker_id, beat.kv_blocks_epoch, beat.kv_blocks_seq)

    async def tick(self, serving: list[Heartbeat], now: float) -> None:
        """Drop the workers that are no longer live (or drain), then ask for the snapshots that are due."""
        live = {b.worker_id for b in serving}
        for worker_id in (self.sync.known() | self.index.workers()) - live:
            self.sync.drop(worker_id)
        wanted = self.sync.wanted(now)
        if wanted and self._nc is not None and self._nc.is_connected:
            try:
                request = encode(KvSnapshotRequest(sorted(wanted)))
                await self._nc.publish(kv_snapshot_subject(self.model), request, reply=self._inbox)
            except Exception as exc:  # asked again after SNAPSHOT_RETRY_S
                log.warning("could not ask for prefix-cache snapshots: %s", exc)

    def route(self, job: GenerationJob, serving: list[Heartbeat], queued: Mapping[str, int]) -> Route:
        beats = [b for b in serving if b.role in _TAKES_PREFILL]
        candidates = self._candidates(job, beats, queued)
        return choose(len(job.prompt_token_ids), candidates, job.cache_key)

    def route_decode(self, job: GenerationJob, serving: list[Heartbeat]) -> str | None:
        if not self.decode_kv_reuse:
            return None
        beats = [b for b in serving if b.role is Role.DECODE]
        cached = self._cached(job, beats)
        candidates = [
            DecodeCandidate(b.worker_id, cached.get(b.worker_id, 0), b.fit_blocks * b.block_size, b.running)
            for b in beats
        ]
        chosen = choose_decode(len(job.prompt_token_ids), candidates)
        if chosen is None:
            return None
        metrics.DECODE_ROUTES.labels(self.model, "gateway").inc()
        return chosen.worker_id

    def _cached(self, job: GenerationJob, beats: list[Heartbeat]) -> dict[str, int]:
        """The prompt's leading tokens each worker's cache holds (whole blocks, at most the prompt less one)."""
        prompt = job.prompt_token_ids
        root = root_hash(job.model, job.cache_salt)
        by_size: dict[int, list[str]] = {}  # block size → the workers that hash at it
        for b in beats:
            size = self.index.block_size(b.worker_id)
            if size is not None:
                by_size.setdefault(size, []).append(b.worker_id)
        cached: dict[str, int] = {}
        for size, workers in by_size.items():
            blocks = self.index.prefix_blocks(_lazy_block_hashes(prompt, size, root), workers)
            # the engine computes the prompt's last token whatever it holds
            cached.update({w: min(n * size, max(len(prompt) - 1, 0)) for w, n in blocks.items()})
        return cached

    def _candidates(self, job: GenerationJob, beats: list[Heartbeat], queued: Mapping[str, int]) -> list[Candidate]:
        cached = self._cached(job, beats)
        candidates = []
        for b in beats:
            load = b.waiting_tokens + queued.get(b.worker_id, 0)
            overloaded = load >= self.max_queued_tokens
            candidates.append(Candidate(b.worker_id, cached.get(b.worker_id, 0), load, b.running, overloaded))
        return candidates


def _lazy_block_hashes(tokens: list[int], block_size: int, root: int) -> Iterator[int]:
    """shared.prefix_hash.block_hashes, one block at a time: the index stops reading at the first block nobody
    holds, so a prompt no worker holds costs one hash, not one per block."""
    h = root
    for i in range(len(tokens) // block_size):
        h = block_hash(h, tokens[i * block_size : (i + 1) * block_size])
        yield h


def prefill_routing(settings: GatewaySettings) -> PrefillRouting:
    return KvRouting(settings) if settings.kv_aware_routing else SharedQueue(settings)


def route_subject(model: str, route: Route) -> str:
    """The queue a routed job is published to: its worker's own, or the shared one."""
    return prefill_subject(model) if route.worker_id is None else routed_prefill_subject(model, route.worker_id)


def count_route(model: str, route: Route) -> None:
    """The routing metrics of a job published as `route` says."""
    metrics.PREFILL_ROUTES.labels(model, "gateway", route.how.value).inc()
    if route.hit_tokens:
        metrics.ROUTED_PREFIX_HIT_TOKENS.labels(model, "gateway").inc(route.hit_tokens)
