"""Pulls of a head slice (a decode rank of a group taking its heads from a prefill group's rank).

A Pull with `kv_head_count` > 0 names global KV heads [start, start + count) and how many transfers the
decode group makes (`group_pulls`); the server hands both to a source that serves head slices
(`shared.kv.group_held.RankHeldKv`). A count of 0 is a whole-KV pull, exactly as before groups existed.
"""

from __future__ import annotations

from typing import Protocol, TypedDict, runtime_checkable

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.kv.transfer.source import KvSource, Outgoing
from shared.rpc import kv_transfer_pb2 as pb


class HeadsRefused(ValueError):
    """A head slice the source cannot serve (the server answers INVALID_ARGUMENT; the KV stays held)."""


@runtime_checkable
class SlicedKvSource(Protocol):
    async def begin_send_heads(self, request_id: str, heads: range, group_pulls: int, /) -> KVExport: ...


class HeadFields(TypedDict, total=False):
    """PullRequest's head fields (proto fields 6-8)."""

    kv_head_start: int
    kv_head_count: int
    group_pulls: int


def head_fields(layout: KVLayout, group_pulls: int) -> HeadFields:
    """The Pull's head fields for a receiver of `layout`: its `kv_heads` (contiguous), or none (whole KV)."""
    if not layout.kv_heads:
        return HeadFields()
    start, count = layout.kv_heads[0], len(layout.kv_heads)
    if layout.kv_heads != tuple(range(start, start + count)):
        raise ValueError(f"a pull takes contiguous KV heads, not {layout.kv_heads}")
    if group_pulls < 1:
        raise ValueError("a head-slice pull needs the decode group's number of transfers (group_pulls >= 1)")
    return HeadFields(kv_head_start=start, kv_head_count=count, group_pulls=group_pulls)


async def begin_send(source: KvSource, request_id: str, request: pb.PullRequest) -> Outgoing:
    """`source.begin_send`, or of the head slice the Pull names. HeadsRefused for a bad slice."""
    if request.kv_head_count == 0:
        return await source.begin_send(request_id)
    if not isinstance(source, SlicedKvSource):
        raise HeadsRefused("this worker serves whole-KV pulls only (it is not a rank of a prefill group)")
    heads = range(request.kv_head_start, request.kv_head_start + request.kv_head_count)
    try:
        return await source.begin_send_heads(request_id, heads, max(1, request.group_pulls))
    except ValueError as e:
        raise HeadsRefused(str(e)) from e
