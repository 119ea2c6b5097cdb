"""The expert-parallel combine choice (torch-free: the engine's configuration names it)."""

from __future__ import annotations

from enum import StrEnum


class EPDispatch(StrEnum):
    """How expert-parallel ranks combine the routed experts' outputs (shared/model/expert_parallel.py):
    alltoall = token slices dispatched to the experts' ranks and back, then all-gathered; allreduce = every
    rank computes its experts for all tokens, then one all-reduce."""

    ALLTOALL = "alltoall"
    ALLREDUCE = "allreduce"
