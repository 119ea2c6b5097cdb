"""The worker's Prometheus gauges, set from an engine-load snapshot (never from the engine itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.telemetry import metrics
from shared.worker.engine_load import EngineLoad

if TYPE_CHECKING:  # torch-free at import, like the rest of this module
    from shared.model.expert_parallel import RankLoad
    from shared.parallel.eplb import EplbStats


def record_load(labels: tuple[str, str], load: EngineLoad) -> None:
    """Requests running and waiting, the KV cache's usage (group 0's, and every group's by its index) and the
    prefix cache's counts, labelled (model_name, role)."""
    metrics.REQUESTS_RUNNING.labels(*labels).set(load.running)
    metrics.REQUESTS_WAITING.labels(*labels).set(load.waiting)
    metrics.KV_CACHE_USAGE.labels(*labels).set(load.usage)
    for group, (free, total, usage) in enumerate(
        zip(load.group_free_blocks, load.group_total_blocks, load.group_usage(), strict=True)
    ):
        metrics.KV_CACHE_GROUP_USAGE.labels(*labels, str(group)).set(usage)
        metrics.KV_CACHE_GROUP_FREE_BLOCKS.labels(*labels, str(group)).set(free)
        metrics.KV_CACHE_GROUP_BLOCKS.labels(*labels, str(group)).set(total)
    p = load.prefix_cache
    metrics.record_prefix_cache(*labels, p.queried_tokens, p.hit_tokens, p.evictions, p.cached_blocks, p.hit_rate)


def record_expert_load(labels: tuple[str, str], expert_load: dict[int, list[int]]) -> None:
    """Tokens routed to each expert of each layer since the last call."""
    metrics.record_expert_load(*labels, expert_load)


def record_rank_load(labels: tuple[str, str], rank_load: RankLoad | None) -> None:
    """Expert parallelism: each rank's pairs and the imbalance since the last call (None: no EP, nothing)."""
    if rank_load is not None:
        metrics.record_rank_load(*labels, rank_load.per_rank, rank_load.imbalance)


def record_eplb(labels: tuple[str, str], stats: EplbStats | None) -> None:
    """Live expert re-placement since the last call (None: not on, nothing)."""
    if stats is not None:
        metrics.record_eplb(*labels, stats.rebalances, stats.bytes_moved, stats.pauses_s, stats.window_imbalance)


def record_role(model_name: str, role: str, roles: tuple[str, ...]) -> None:
    """The worker's role gauge: 1 for `role`, 0 for every other of `roles`."""
    for r in roles:
        metrics.WORKER_ROLE.labels(model_name, r).set(1 if r == role else 0)


def forget_load(labels: tuple[str, str], groups: int) -> None:
    """A role left (a switch): its load gauges go (the new role's labels take over), so that a scrape shows no stale
    running requests or KV usage under the old role's label. Counters stay: they are that role's history."""
    plain = (metrics.REQUESTS_RUNNING, metrics.REQUESTS_WAITING, metrics.KV_CACHE_USAGE)
    per_group = (metrics.KV_CACHE_GROUP_USAGE, metrics.KV_CACHE_GROUP_FREE_BLOCKS, metrics.KV_CACHE_GROUP_BLOCKS)
    removals = [(g, labels) for g in (*plain, metrics.PREFIX_CACHE_HIT_RATE, metrics.PREFIX_CACHE_BLOCKS)]
    removals += [(g, (*labels, str(i))) for g in per_group for i in range(groups)]
    for gauge, values in removals:
        try:
            gauge.remove(*values)
        except KeyError:  # never set under this role
            pass
