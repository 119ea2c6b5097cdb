"""The model of one rank of a worker group, from the engine's configuration: the parallel settings (`tp`, `ep`,
`ep_dispatch`, `expert_placement`) turned into load_model's arguments. The engine loads its model with this."""

from __future__ import annotations

from shared.engine.config import EngineConfig
from shared.model.device import resolve_device
from shared.model.loader import load_model
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement, PlacementError


def load_rank_model(config: EngineConfig, group: RankGroup) -> CausalLM:
    """This rank's shard of `config.model` under `config.parallel` (the whole model at tp = ep = 1). A placement
    file that does not match the model or the group is refused (PlacementError, a ValueError) before any weight
    is read."""
    layout = config.parallel
    placement = None
    if config.expert_placement is not None:
        if layout.ep == 1:
            raise PlacementError("expert_placement is set but ep=1: a placement needs expert parallelism")
        placement = ExpertPlacement.from_file(config.expert_placement)
    return load_model(
        config.model,
        dtype=config.dtype,
        device=resolve_device(config.device),
        group=group,
        layout=layout,
        expert_placement=placement,
        ep_dispatch=config.ep_dispatch,
        quantization=config.quantization,
    )
