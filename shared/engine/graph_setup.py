"""Whether an engine captures its decode steps (decode_graphs.py), and the capture itself.

Chosen before the KV pool is allocated (with graphs every pool gets a scratch block that padded rows write),
captured after it exists (the graphs hold its address). One start-up line either way.
"""

from __future__ import annotations

import logging

import torch

from shared.engine.config import EngineConfig
from shared.engine.decode_graphs import CaptureReport, DecodeGraphs, GraphBackend, bucket_sizes, choose_backend
from shared.engine.kv_cache import KvCache
from shared.model.kernels.choice import KernelChoice
from shared.model.transformer import CausalLM

log = logging.getLogger(__name__)


def graph_backend(
    config: EngineConfig,
    device: torch.device,
    kernels: KernelChoice,
    model: CausalLM,
    world: int,
    forced: GraphBackend | None,
) -> tuple[GraphBackend | None, str]:
    """The decode-graph backend (None: off) and why it is off. `forced` (tests, the gpu-check's CPU rehearsal:
    decode_graphs.EagerReplay) replaces what the settings choose, but cuda_graphs off still turns it off."""
    backend, why_not = choose_backend(config.cuda_graphs, device, kernels)
    if backend is not None and world > 1:
        # the step's collectives would be captured too: not verified on NCCL yet, impossible on gloo
        backend, why_not = None, f"off (a worker group of {world} ranks: collectives not captured)"
    if forced is not None and config.cuda_graphs:
        backend = forced
    if config.ep > 1 and backend is not None:  # the EP combine reads pair counts on the host per layer
        backend, why_not = None, "off (expert parallelism, ep > 1: its combine is not capturable)"
    if model.config.windows and backend is not None:  # the graphs' metadata has no windowed views yet
        backend, why_not = None, "off (sliding-window layers: not captured yet)"
    return backend, why_not


def capture_graphs(
    model: CausalLM,
    kv: KvCache,
    config: EngineConfig,
    max_model_len: int,
    backend: GraphBackend | None,
    why_not: str,
) -> tuple[DecodeGraphs | None, CaptureReport | None]:
    """The decode graphs captured over the real pool (its scratch block: id = the plan's block count, which the
    block manager never hands out), and what capturing took; (None, None) when off or when capture fails (a
    first GPU run is not stopped by an op that refuses capture: every step runs eagerly). Logs one line."""
    if backend is None:
        log.info("decode graphs: %s", why_not)
        return None, None
    graphs = DecodeGraphs(
        model,
        kv.pool.layer_caches(),
        config.block_size,
        scratch_block=kv.plans[0].num_blocks,
        max_model_len=max_model_len,
        sizes=bucket_sizes(config.scheduler.max_num_seqs),
        backend=backend,
    )
    try:
        report = graphs.capture()
    except Exception:
        log.exception("decode graphs: capture failed (%s); every step runs eagerly", backend.name)
        return None, None
    log.info("%s", report.summary())
    return graphs, report
