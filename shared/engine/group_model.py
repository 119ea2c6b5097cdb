"""The model of one rank of a worker group, from the engine's configuration: the parallel settings (`tp`, `ep`,
`ep_dispatch`, `expert_placement`) turned into load_model's arguments. The engine loads its model with this."""

from __future__ import annotations

from shared.engine.config import EngineConfig
from shared.model.config import ModelConfig
from shared.model.device import resolve_device
from shared.model.loader import load_model
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup
from shared.sharding.placement import ExpertPlacement, PlacementError
from shared.sharding.rebalance import initial_placement


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
    if config.eplb.enabled:
        placement = _live_placement(config, placement)
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


def _live_placement(config: EngineConfig, given: ExpertPlacement | None) -> ExpertPlacement:
    """The placement a group re-placing its experts live (--eplb) loads with: the given one, or the initial one
    with --eplb-redundant replicas; refused (PlacementError) for a model without routed experts, or slots that
    --eplb-redundant cannot fill."""
    cfg = ModelConfig.from_dir(config.model)
    layers = sorted(cfg.sparse_layers)
    if not cfg.is_moe or not layers:
        raise PlacementError(f"--eplb re-places routed experts: {config.model} is not a mixture-of-experts model")
    e, ep, redundant = cfg.num_experts, config.ep, config.eplb.redundant
    if (e + redundant) % ep or redundant > e * (ep - 1):
        raise PlacementError(
            f"--eplb-redundant {redundant}: {e} experts + {redundant} redundant slots must split evenly over ep={ep} "
            f"and hold each expert at most once per rank (at most {e * (ep - 1)} redundant)"
        )
    slots = (e + redundant) // ep
    if given is not None:
        given.check_model(e, layers, ep)
        if given.slots_per_rank != slots:
            raise PlacementError(
                f"--expert-placement holds {given.slots_per_rank} slots per rank, --eplb-redundant {redundant} "
                f"asks for {slots}: they must agree"
            )
        return given
    return initial_placement(e, ep, layers, redundant)
