"""The prefill side's half of a shared-memory send (shm.py has the segments): does the region a Pull offers
hold the KV, and the blocking gather into it, with the test-only faults of the transfer server."""

from __future__ import annotations

import time

import torch

from shared.engine.kv_export import KVExport
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.shm import ALIGN, Segment
from shared.kv.transfer.source import Outgoing
from shared.model.kernels import cpu_stream_copy


class InjectedFault(RuntimeError):
    """The failure `fault_send_midway` makes: the send stopped after its first piece (or half its bytes)."""


def shape_of(kv: Outgoing) -> tuple[int, ...]:
    return tuple(kv.shape) if isinstance(kv, PoolKv) else tuple(kv.blocks.shape)


def fits(segment: Segment | None, offset: int, capacity: int, kv: Outgoing) -> bool:
    """The region [offset, offset + capacity) of the pair's segment holds this KV (else it goes over the pair).
    Offsets and capacities come from the puller: checked against the segment, never trusted."""
    if segment is None or capacity == 0:
        return False
    return kv.nbytes <= capacity and offset + capacity <= segment.nbytes and offset % ALIGN == 0


def copy_into_region(kv: Outgoing, region: torch.Tensor, fault_midway: bool = False, stall_s: float = 0.0) -> None:
    """Blocking (a send thread): the KV into the region, one gather. With a fault (testing only): half the
    bytes, then a sleep of stall_s, then InjectedFault (fault_midway) or the other half."""
    if not (fault_midway or stall_s):
        if isinstance(kv, PoolKv):
            # The decode process reads it next, not this core: streaming stores, unless the cache can keep it.
            kv.copy_into(region, streaming=kv.nbytes >= cpu_stream_copy.min_bytes())
        else:
            region.copy_(kv.blocks)
        return
    flat = region.view(-1)
    half = flat.numel() // 2
    src = (kv.blocks if isinstance(kv, KVExport) else kv.pool.read(kv.block_ids)).reshape(-1)
    flat[:half].copy_(src[:half])
    time.sleep(stall_s)
    if fault_midway:
        raise InjectedFault("injected fault: wrote half the KV into shared memory, then dropped the pair")
    flat[half:].copy_(src[half:])
