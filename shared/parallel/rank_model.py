"""The model one rank of a worker group loads.

Until the sharded loader lands (each rank reading only its slices), every rank loads the whole checkpoint: the
group's mechanics (op stream, pools, failure) are then exactly testable, each follower's KV pool byte-identical
to its leader's. The sharded load replaces the body of `load_rank_model`, nothing else.
"""

from __future__ import annotations

import torch

from shared.engine.config import EngineConfig
from shared.model.loader import load_model
from shared.model.transformer import CausalLM
from shared.parallel.group import RankGroup
from shared.parallel.layout import ParallelLayout


def load_rank_model(config: EngineConfig, group: RankGroup, layout: ParallelLayout, device: torch.device) -> CausalLM:
    """This rank's model on `device` (the resolved config.device); replicated for now: `group` and `layout` say
    which shard it will be."""
    del group, layout  # the sharded load: load_model(..., group=group, layout=layout)
    return load_model(config.model, dtype=config.dtype, device=device)
