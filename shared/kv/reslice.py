"""Re-slicing KV between worker groups of different tensor-parallel layouts (pure: no I/O, no torch).

A prefill group of TP = a and a decode group of TP = b hold the same model's KV heads split differently
(`shared.sharding.layout.kv_head_range`: contiguous slices, or replicas when heads are fewer than ranks).
For decode rank j, `plan_pulls` says which prefill rank sends which of its pool's heads into which of j's
pool positions, so every decode rank pulls exactly the heads it owns, rank to rank. `check_compatible` refuses
a pair of groups whose KV cannot be exchanged (another model, dtype or head dim) with a message that names the
difference; `group_record` builds the prefill group's record for the Redis location.

A latent cache (multi-head latent attention, `KVLayout.planes == 1`) is one "head" that every rank holds whole
(num_kv_heads = 1: replicated on all ranks), so the same rules give each decode rank one whole-latent pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_pool import KVLayout
from shared.kv.registry import GroupKv, RankKv
from shared.sharding.layout import kv_head_holders, kv_head_range


class IncompatibleKv(ValueError):
    """The two groups' KV cannot be exchanged (the decode side recomputes); the message says why."""


@dataclass(frozen=True)
class HeadPull:
    """One transfer of a pull plan: heads `src` of prefill rank `rank`'s pool (pool positions) land in
    positions `dst` of the decode rank's pool. `heads` are their global ids (what the Pull names)."""

    rank: int
    heads: range  # global KV head ids, contiguous
    src: range  # positions in the prefill rank's pool
    dst: range  # positions in the decode rank's pool


def plan_pulls(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadPull]:
    """The transfers that fill decode rank `dst_rank` of a tp = `dst_tp` group from a tp = `src_tp` group.

    Each head it needs comes from one of its holders; with replicas (fewer heads than prefill ranks) decode
    ranks are spread over them (the i-th decode rank needing a head takes its i-th holder, round robin).
    Consecutive heads from one prefill rank are merged into one transfer. Raises LayoutError for a TP the
    heads do not split over, ValueError for a rank outside the group."""
    if not 0 <= dst_rank < dst_tp:
        raise ValueError(f"decode rank {dst_rank} is not in a group of tp={dst_tp}")
    holders = kv_head_holders(num_kv_heads, src_tp)
    src_heads = [kv_head_range(num_kv_heads, src_tp, r) for r in range(src_tp)]
    needed = kv_head_range(num_kv_heads, dst_tp, dst_rank)
    plan: list[HeadPull] = []
    for pos, head in enumerate(needed):
        # which of the decode ranks that need this head is dst_rank (replicated decode heads share holders)
        sharers = [r for r in range(dst_tp) if head in kv_head_range(num_kv_heads, dst_tp, r)]
        choices = holders[head]
        rank = choices[sharers.index(dst_rank) % len(choices)]
        src_pos = src_heads[rank].index(head)
        last = plan[-1] if plan else None
        if last is not None and last.rank == rank and last.heads.stop == head and last.src.stop == src_pos:
            plan[-1] = HeadPull(
                rank,
                range(last.heads.start, head + 1),
                range(last.src.start, src_pos + 1),
                range(last.dst.start, pos + 1),
            )
        else:
            plan.append(HeadPull(rank, range(head, head + 1), range(src_pos, src_pos + 1), range(pos, pos + 1)))
    return plan


def group_pulls(num_kv_heads: int, src_tp: int, dst_tp: int) -> int:
    """How many transfers the whole decode group makes: the prefill group frees the KV after that many."""
    return sum(len(plan_pulls(num_kv_heads, src_tp, dst_tp, j)) for j in range(dst_tp))


def group_record(layout: KVLayout, tp: int, addresses: list[str]) -> GroupKv:
    """The prefill group's record: `layout` is the model's (all heads), `addresses` each rank's KvTransfer."""
    if len(addresses) != tp:
        raise ValueError(f"a group of tp={tp} needs {tp} rank addresses, got {len(addresses)}")
    ranks = [RankKv(r, a, list(kv_head_range(layout.num_kv_heads, tp, r))) for r, a in enumerate(addresses)]
    return GroupKv(
        tp, ranks, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_size,
        layout.planes,
    )  # fmt: skip


def record_layout(record: GroupKv) -> KVLayout:
    """The model's KV layout (all heads) a group record describes."""
    return KVLayout(
        record.num_layers, record.num_kv_heads, record.head_dim, record.block_size, record.dtype, planes=record.planes
    )


def check_compatible(record: GroupKv, layout: KVLayout, dst_tp: int) -> None:
    """Pass if a decode group of tp = `dst_tp` whose model KV layout is `layout` can pull from the group
    `record` describes; else IncompatibleKv naming what differs. Block sizes may differ (re-cut on import)."""
    theirs = {"layers": record.num_layers, "KV heads": record.num_kv_heads, "head dim": record.head_dim}
    ours = {"layers": layout.num_layers, "KV heads": layout.num_kv_heads, "head dim": layout.head_dim}
    theirs["planes"], ours["planes"] = record.planes, layout.planes  # a latent cache is not K|V
    theirs["dtype"], ours["dtype"] = record.dtype, layout.dtype  # type: ignore[assignment]
    differ = [f"{k} {theirs[k]} (prefill) vs {ours[k]} (decode)" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise IncompatibleKv("the groups hold different models' KV: " + ", ".join(differ))
    if record.tp != len(record.ranks) or [r.rank for r in record.ranks] != list(range(record.tp)):
        raise IncompatibleKv(
            f"the prefill group record lists ranks {[r.rank for r in record.ranks]} for tp={record.tp}"
        )
    for r in record.ranks:
        if r.kv_heads != list(kv_head_range(record.num_kv_heads, record.tp, r.rank)):
            raise IncompatibleKv(f"prefill rank {r.rank} holds KV heads {r.kv_heads}, not its tp={record.tp} slice")
    kv_head_range(layout.num_kv_heads, dst_tp, 0)  # LayoutError if the decode TP does not fit the heads
