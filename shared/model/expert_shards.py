"""A whole model's experts across an expert-parallel group: each sparse layer given this rank's slots and its
`ExpertParallel` (`shard_experts`, at load), and the per-rank load read back from them (`take_rank_load`, once
per heartbeat). The per-layer dispatch itself is expert_parallel.py's."""

from __future__ import annotations

import torch

from shared.model.expert_parallel import ExpertParallel, RankLoad
from shared.model.moe import MoE
from shared.model.transformer import CausalLM
from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement


def shard_experts(
    model: CausalLM,
    group: RankGroup,
    placement: ExpertPlacement | None,
    mode: EPDispatch | str,
    data_parallel: bool = False,
) -> ExpertPlacement:
    """Give every sparse layer of a model still on the meta device (before `to_empty`) only this rank's
    expert slots, and its ExpertParallel; → the placement used (the default when None). `data_parallel`: each
    rank brings its own tokens to the MoE layers (data-parallel attention; the dispatch is then all-to-all)."""
    cfg = model.config
    layers = sorted(model.sparse_layers())
    placement = placement or ExpertPlacement.default(cfg.num_experts, group.world, layers)
    placement.check_model(cfg.num_experts, layers, group.world)
    for index, moe in model.sparse_layers().items():
        old = moe.experts
        if old.gate_up.device.type != "meta":
            raise RuntimeError("shard_experts runs before the weights are allocated (the model on meta)")
        with torch.device("meta"):
            experts = old.with_slots(placement.slots(index, group.rank))
        experts.kernels = old.kernels
        moe.experts = experts
        moe.dispatch = ExpertParallel(
            group, placement.layers[index], cfg.num_experts, EPDispatch(mode), data_parallel=data_parallel
        )
    return placement


def take_rank_load(model: torch.nn.Module) -> RankLoad | None:
    """The per-rank load since the last call (one host read), and reset; None without expert parallelism."""
    dispatches = [m.dispatch for m in model.modules() if isinstance(m, MoE) and m.dispatch is not None]
    if not dispatches:
        return None
    per_rank = torch.stack([d.rank_load for d in dispatches]).sum(0)
    peak = torch.stack([d.peak_load for d in dispatches]).sum()
    host = torch.cat([per_rank, peak.unsqueeze(0)]).cpu().tolist()
    for d in dispatches:
        d.rank_load.zero_()
        d.peak_load.zero_()
    return RankLoad(per_rank=host[:-1], peak=host[-1])
