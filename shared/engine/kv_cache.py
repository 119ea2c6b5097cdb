"""The engine's KV cache, planned and allocated: per KV cache group its plan, pool and block manager.

`plan_kv_cache` runs once per engine, after the model is on its device and ready (kernel_setup.py): it sizes the
pool (kv_measure.py: the budget, on CUDA measured around a dummy step), agrees the block count across a
worker group's ranks (the smallest), splits the plan between the model's KV cache groups (kv_groups.py) and
allocates one pool and one block manager per group. Group 0's are `pool` and `blocks` (the only ones of a
one-group model). Single-rank engines only group: a worker group keeps one pool of every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.dp_blocks import DpBlockManager
from shared.engine.kv_budget import GroupNeed, KvPlan, grouped_summary, split_plan
from shared.engine.kv_groups import KVGroup, kv_groups, window_live_blocks
from shared.engine.kv_measure import plan_kv_pool
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.prefix_cache import CacheEvents, PrefixCache
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup
from shared.sharding.layout import kv_head_range

log = logging.getLogger(__name__)


@dataclass
class KvCache:
    """One engine's KV: the model's layout (this rank's KV heads), per KV cache group its layers and window,
    its plan, its pool and its block manager, all in group order. `pools` is the list the engine, its runner
    and its forks share: a worker group's leader replaces `pools[0]` by its mirrored pool in place."""

    layout: KVLayout
    groups: tuple[KVGroup, ...]
    plans: list[KvPlan]
    pools: list[KVPool]
    blocks: list[BlockManager]

    @property
    def pool(self) -> KVPool:
        """Group 0's pool: derived, so replacing `pools[0]` cannot leave a second reference behind."""
        return self.pools[0]

    @property
    def windows(self) -> tuple[int, ...]:
        """The windows of the groups after the first, in order (each has one: kv_groups.py)."""
        return tuple(g.window for g in self.groups[1:] if g.window is not None)

    def layer_caches(self) -> list[torch.Tensor] | None:
        """Per model layer, its (P, N_g, B, KVH, hd) view of its group's pool; None for one group (the runner
        reads the pool's own layers)."""
        if len(self.pools) == 1:
            return None
        caches: dict[int, torch.Tensor] = {}
        for g, pool in zip(self.groups, self.pools, strict=True):
            caches.update(zip(g.layers, pool.layer_caches(), strict=True))
        return [caches[layer] for layer in range(self.layout.num_layers)]  # every layer is in one group


def plan_kv_cache(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    group: RankGroup,
    max_model_len: int,
    non_torch_at_start: int,
    scratch_block: bool,
) -> KvCache:
    """Plan, agree, split and allocate the KV cache (module doc); logs the start-up line. `scratch_block`: each
    pool gets one block more than its plan, which no block manager hands out (decode graphs' padded rows write
    it: decode_graphs.py)."""
    mc = model.config
    dtype = next(model.parameters()).dtype
    tp = config.parallel.tp
    kv_heads = tuple(kv_head_range(mc.num_kv_heads, tp, group.rank)) if tp > 1 else ()
    layout = KVLayout.for_model(mc, config.block_size, str(dtype).removeprefix("torch."), kv_heads)
    # after the weights (and their packed twins): on CUDA the plan measures what they left
    plan = plan_kv_pool(config, layout, max_model_len, model, non_torch_at_start=non_torch_at_start)
    if group.world > 1:  # a group's ranks share one block manager (the leader's): the smallest pool
        agreed = group.agree_min("kv_blocks", plan.num_blocks)
        if agreed != plan.num_blocks:
            plan = replace(plan, num_blocks=agreed, budget=f"{plan.budget}, the group's smallest rank: {agreed} blocks")
    groups, plans = _split_groups(config, layout, plan, max_model_len, group.world)
    shared = share_pool(config.kv_shared_memory, device, len(groups), group.world)
    pools = [
        KVPool(g.layout(layout), p.num_blocks + scratch_block, device, shared)
        for g, p in zip(groups, plans, strict=True)
    ]
    blocks: list[BlockManager]
    if config.parallel.data_parallel:  # every rank's pool in one id space, a request on one rank (dp_blocks.py)
        if config.enable_prefix_caching:
            log.info("prefix caching: off under --dp-attention (the ranks' partitioned pool has no prefix cache yet)")
        blocks = [DpBlockManager(group.world, p.num_blocks, config.block_size) for p in plans]
    else:
        blocks = [
            BlockManager(p.num_blocks, config.block_size, _prefix_cache(config, routed=g == 0))
            for g, p in enumerate(plans)
        ]
    return KvCache(layout, groups, plans, pools, blocks)


def _prefix_cache(config: EngineConfig, routed: bool) -> PrefixCache | None:
    """A group's prefix cache when caching is on; group 0's (`routed`) records events for the router."""
    if not config.enable_prefix_caching:
        return None
    return PrefixCache(CacheEvents() if routed else None)


def _split_groups(
    config: EngineConfig, layout: KVLayout, plan: KvPlan, max_model_len: int, world: int
) -> tuple[tuple[KVGroup, ...], list[KvPlan]]:
    """The model's KV cache groups and each one's share of `plan` (one group: the plan as it is). Logs the
    start-up line."""
    num_layers = layout.num_layers
    groups = kv_groups(num_layers, layout.layer_windows)
    if len(groups) > 1 and world > 1:
        # a worker group's ranks mirror one pool and send one table per step (step_inputs.py): not grouped
        # yet, so the hybrid model keeps one pool of every layer there, as before groups (nothing freed)
        log.info("KV cache groups: off on a worker group of %d ranks (one pool, every block kept)", world)
        groups = (KVGroup(tuple(range(num_layers)), None),)
    if len(groups) == 1:
        log.info("%s", plan.summary())
        return groups, [plan]
    b = config.block_size
    chunk = min(config.scheduler.max_num_batched_tokens, max_model_len)
    needs = []
    for g in groups:
        full = -(-max_model_len // b)
        per_request = full if g.window is None else min(full, window_live_blocks(g.window, b, chunk))
        name = "full" if g.window is None else f"window {g.window}"
        needs.append(GroupNeed(name, g.layout(layout).bytes_per_block, per_request))
    plans = split_plan(plan, needs)
    log.info("%s", grouped_summary(needs, plans))
    return groups, plans


def share_pool(wanted: bool, device: torch.device, num_groups: int, world: int) -> bool:
    """Whether the pool goes in shared memory (EngineConfig.kv_shared_memory), where that is supported."""
    why_not = None
    if not wanted:
        return False
    if device.type != "cpu":
        why_not = f"the pool is on {device}"
    elif num_groups > 1:
        why_not = f"{num_groups} KV cache groups (their hand-offs are exports)"
    elif world > 1:
        why_not = "a worker group's ranks hold head slices (pulled rank by rank)"
    if why_not is not None:
        log.info("KV pool in shared memory: off (%s)", why_not)
    else:
        log.info("KV pool in shared memory: a sealed memfd, which same-host decode workers map read-only")
    return why_not is None
