"""The engine a worker runs, and the engine's sampling parameters from a job's."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from shared.engine.build_thread import on_a_passing_thread
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.messages import Sampling
from shared.sampling_spec import SAMPLING_FIELDS
from shared.settings import WorkerSettings

if TYPE_CHECKING:
    from shared.parallel.group_engine import WorkerGroup


def sampling_params(s: Sampling, max_tokens: int | None = None) -> SamplingParams:
    """The engine's parameters from the wire's: every field shared/sampling_spec.py declares, by name, with the
    sequences as tuples (logit_bias as sorted (token id, bias) pairs); `max_tokens` overrides the job's."""
    fields: dict[str, Any] = {f.name: getattr(s, f.name) for f in SAMPLING_FIELDS}
    fields["stop_token_ids"] = tuple(s.stop_token_ids)
    fields["logit_bias"] = tuple(sorted(s.logit_bias.items()))
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return SamplingParams(**fields)


def build_engine(settings: WorkerSettings) -> tuple[Engine, WorkerGroup | None]:
    """The worker's engine, and with --tp/--ep > 1 the worker group it leads (else None): the group's other
    ranks this process spawns (they die with it; one that dies takes this process down: shared/parallel/watch.py).
    The engine knows nothing of its group: the worker keeps both."""
    # the gateway hashes prompts under the model name it serves: the engine's cache must name blocks alike
    config = dataclasses.replace(settings.engine, prefix_cache_namespace=settings.served_model_name)
    if settings.kv.share_pool and settings.kv.shm_bytes:
        # same-host decode workers borrow a prefill worker's blocks; every role's pool is shareable, since a worker
        # of any role may switch to prefill (docs/architecture.md, "Role switching")
        config = dataclasses.replace(config, kv_shared_memory=True)
    if max(config.tp, config.ep) == 1:  # built off the main thread: the engine thread's is then the only OpenMP pool
        return on_a_passing_thread(lambda: Engine.build(config)), None
    from shared.parallel.group_engine import start_group

    group = start_group(config)
    return group.engine, group
