"""How a worker group divides the model: `ParallelLayout` (the degrees) and which rank owns which heads and
experts. Pure arithmetic, no torch.distributed: the model, the KV pool, the hand-off's re-slicing and the
placement planner all read ownership from here, so they cannot disagree.

A group has R = max(tp, ep, dp) ranks, and each degree is 1 or R: TP = 2 (attention and dense MLPs split over
2 ranks, experts replicated), EP = 2 (experts partitioned over 2 ranks, attention replicated), or TP = 2 with
EP = 2 (both over the same 2 ranks). DP = R (data-parallel attention, --dp-attention) goes with EP = R and TP = 1:
each rank runs attention and the dense layers for its own requests over its own KV, the experts are partitioned
over all R ranks (shared/parallel/dp_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout the model or the group cannot take (the message says what to change)."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor-parallel degree: attention heads, dense MLPs
    ep: int = 1  # expert-parallel degree: routed experts
    dp: int = 1  # data-parallel attention degree: each rank its own requests' attention and KV (1 or ep)

    def __post_init__(self) -> None:
        for name, degree in (("tp", self.tp), ("ep", self.ep), ("dp", self.dp)):
            if degree < 1:
                raise LayoutError(f"--{name} must be at least 1, got {degree}")
        if min(self.tp, self.ep) != 1 and self.tp != self.ep:
            raise LayoutError(
                f"--tp {self.tp} with --ep {self.ep}: a group's degrees are each 1 or the group size "
                "(e.g. --tp 2 --ep 2, or one of them alone)"
            )
        if self.dp > 1 and (self.tp != 1 or self.ep != self.dp):
            raise LayoutError(
                f"data-parallel attention over {self.dp} ranks with --tp {self.tp} --ep {self.ep}: it runs the "
                f"experts expert-parallel over the same ranks, without tensor parallelism (--ep {self.dp}, --tp 1)"
            )

    @property
    def world(self) -> int:
        """Ranks (processes) in the group."""
        return max(self.tp, self.ep, self.dp)

    @property
    def single(self) -> bool:
        return self.world == 1

    def __str__(self) -> str:
        return f"tp={self.tp} ep={self.ep}" + (f" dp={self.dp}" if self.dp > 1 else "")

    @property
    def data_parallel(self) -> bool:
        """Attention data-parallel over the ranks (each its own requests), experts expert-parallel."""
        return self.dp > 1


def head_range(num_heads: int, tp: int, rank: int) -> range:
    """The query heads tensor-parallel rank `rank` of `tp` computes: a contiguous 1/tp of them."""
    if num_heads % tp:
        raise LayoutError(f"{num_heads} attention heads do not split over tp={tp}: choose a tp that divides them")
    per = num_heads // tp
    return range(rank * per, (rank + 1) * per)


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank `rank` of `tp` holds in its cache. With at least as many KV heads as ranks each rank
    holds a contiguous 1/tp of them; with fewer, each KV head is replicated on tp / num_kv_heads consecutive
    ranks (rank r holds head r // (tp / num_kv_heads)), so every rank's query heads find their KV head."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise LayoutError(f"{num_kv_heads} KV heads do not split over tp={tp}: choose a tp that divides them")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise LayoutError(f"tp={tp} is not a multiple of the model's {num_kv_heads} KV heads")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def kv_head_holders(num_kv_heads: int, tp: int) -> dict[int, list[int]]:
    """KV head → the ranks of a tp group that hold it (several when heads are replicated)."""
    holders: dict[int, list[int]] = {h: [] for h in range(num_kv_heads)}
    for rank in range(tp):
        for head in kv_head_range(num_kv_heads, tp, rank):
            holders[head].append(rank)
    return holders


def split_range(size: int, parts: int, index: int, what: str) -> range:
    """Part `index` of `size` rows cut into `parts` equal contiguous parts (intermediate sizes, vocabularies)."""
    if size % parts:
        raise LayoutError(f"{what} of {size} does not split into {parts} equal parts")
    per = size // parts
    return range(index * per, (index + 1) * per)


def expert_range(num_experts: int, ep: int, rank: int) -> range:
    """The routed experts rank `rank` of `ep` holds by default (without a placement file): a contiguous 1/ep."""
    return split_range(num_experts, ep, rank, "the number of experts")
