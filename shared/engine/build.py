"""Building an engine's parts: device and kernel setup, the model, KV planning, graph capture, and the
collaborators the step loop is handed (`EngineParts`; `Engine.build` assembles the engine from them).

Order matters: on CUDA, from the first look at the device until the pool exists, engines sharing the GPU wait
for each other (device_setup.py), and this engine's non-torch memory is counted from that look; the kernels
are chosen before the KV plan (its dummy step runs them); the graph backend before the pool is allocated (a
scratch block), the capture after (the graphs hold the pool's address).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.decode_graphs import CaptureReport, GraphBackend
from shared.engine.device_setup import exclusive_setup
from shared.engine.dp_blocks import DpBlockManager, running_per_rank
from shared.engine.forker import Forker
from shared.engine.graph_setup import capture_graphs, graph_backend
from shared.engine.group_model import load_rank_model
from shared.engine.kernel_setup import prepare_model
from shared.engine.kv_cache import KvCache, plan_kv_cache
from shared.engine.kv_handoff import KvHandoff
from shared.engine.kv_measure import outside_torch
from shared.engine.layer_streams import LayerStreams
from shared.engine.prefix_caching import PrefixCaching
from shared.engine.request import PromptLimits, Request
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler
from shared.engine.scheduler import Scheduler
from shared.engine.structured import StructuredDecoding
from shared.model.device import resolve_device
from shared.model.kernels.choice import KernelChoice
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup
from shared.structured.grammar import Grammars


@dataclass
class EngineParts:
    """Everything an `Engine` runs with. `requests`, `scheduler`, `kv`, `structured` are the engine's state,
    shared (the same objects) by the collaborators that work on it: `runner` (a step), `handoff` (KV out and
    in, layer streams), `forker` (n choices)."""

    config: EngineConfig
    group: RankGroup  # this rank's worker group (a group of one for a single-rank engine)
    device: torch.device
    model: CausalLM
    kernels: KernelChoice
    max_model_len: int
    limits: PromptLimits
    kv: KvCache
    graph_capture: CaptureReport | None  # what capturing the decode graphs took, when on
    requests: dict[str, Request]  # live, or finished and holding KV
    scheduler: Scheduler
    structured: StructuredDecoding  # grammar matchers of the requests with structured output
    layer_streams: LayerStreams  # requests whose KV is sent layer by layer as their last chunk runs
    runner: ModelRunner
    handoff: KvHandoff
    forker: Forker


def build_parts(
    config: EngineConfig,
    model: CausalLM | None = None,
    graph_backend_override: GraphBackend | None = None,
    group: RankGroup | None = None,
) -> EngineParts:
    """An engine's parts for `config`: its model loaded (this rank's shard) unless `model` is given; see
    `Engine.build` for the arguments. ValueError for a configuration the device, model or group refuses."""
    group = group or RankGroup.single()
    if group.world != config.parallel.world:
        raise ValueError(
            f"{config.parallel} needs a group of {config.parallel.world} ranks, got {group.world}: "
            "a parallel engine is started by shared.parallel.group_engine.start_group"
        )
    device = resolve_device(config.device)  # refuses an unknown device or CUDA without one, first
    if config.threads:
        torch.set_num_threads(config.threads)
    with exclusive_setup(device):
        non_torch_at_start = outside_torch(torch.cuda, device) if device.type == "cuda" else 0
        model = model or load_rank_model(config, group)
        kernels = prepare_model(model, config, device)
        mc = model.config
        max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        backend, why_not = graph_backend(config, device, kernels, model, group.world, graph_backend_override)
        kv = plan_kv_cache(config, model, device, group, max_model_len, non_torch_at_start, backend is not None)
    routed = kv.blocks[0].cache  # None unless config.enable_prefix_caching
    prefix = None if routed is None else PrefixCaching(config.prefix_cache_namespace, config.block_size, routed)
    scheduler = Scheduler(
        config.scheduler,
        kv.blocks[0],
        max_model_len,
        eos_token_ids=mc.eos_token_ids,
        window=kv.groups[0].window,
        window_groups=[
            (b, g.window)
            for b, g in zip(kv.blocks[1:], kv.groups[1:], strict=True)
            if g.window is not None  # every group after the first has one (kv_groups.py)
        ],
        prefix=prefix,
    )
    if isinstance(kv.blocks[0], DpBlockManager):  # a request's first blocks go to the rank running fewest
        kv.blocks[0].seqs_of = lambda: running_per_rank(scheduler.running, group.world)
    structured = StructuredDecoding(lambda: Grammars.from_model_dir(config.model, mc.vocab_size, mc.eos_token_ids))
    graphs, capture = capture_graphs(model, kv, config, max_model_len, backend, why_not)
    sampler = Sampler(config.seed)
    runner = ModelRunner(model, kv.pool, sampler, graphs, structured, kv.layer_caches(), kv.windows)
    requests: dict[str, Request] = {}
    layer_streams = LayerStreams(mc.num_layers, config.block_size)
    limits = PromptLimits(max_model_len, mc.vocab_size)
    max_seqs = config.scheduler.max_num_seqs
    handoff = KvHandoff(kv, scheduler, requests, structured, layer_streams, limits, max_seqs, group.world)
    forker = Forker(kv, scheduler, requests, structured, sampler, handoff, limits)
    return EngineParts(
        config, group, device, model, kernels, max_model_len, limits, kv, capture,
        requests, scheduler, structured, layer_streams, runner, handoff, forker,
    )  # fmt: skip
