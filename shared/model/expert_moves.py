"""Moving expert weights between the ranks of an expert-parallel group: one sparse layer's changed slots, in two
halves every rank runs at the same point of its op stream (shared/parallel/eplb.py decides, ops.py carries):

- `stage_layer`: the layer's changed slots (shared/sharding/rebalance.py `layer_changes`: the same list on every
  rank) travel in one all_to_all over the group's collective (gloo on CPU, NCCL on GPU): each sender packs the
  slots others need from it as byte rows, each receiver keeps what it got in a spare buffer. The layer still
  serves from its current slots: nothing it computes with has changed.
- `swap_layer`: the staged rows are copied into their slots, the layer's slot list and its dispatch tables take
  the new placement, and what was derived from the weights (CPU kernel panels, oneDNN packs) is rebuilt.

A slot's bytes are every per-slot tensor of the layer's experts (weights, and biases or scales where the experts
have them): the tensors whose first dimension is the slot count, viewed as bytes, so one row carries them all
whatever their dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.moe import MoE
from shared.sharding.group import RankGroup
from shared.sharding.rebalance import SlotChange


@dataclass
class StagedLayer:
    """This rank's received slots of one layer, waiting for the swap: `rows[i]` is slot `slots[i]`'s bytes."""

    slots: list[int]
    rows: torch.Tensor  # (len(slots), slot bytes) uint8


def slot_tensors(moe: MoE) -> list[torch.Tensor]:
    """The experts' per-slot tensors, in a fixed order (by name): every parameter stacked over the slots, then
    load-time int8's quantized weights and scales where the experts keep them (shared/model/int8.py)."""
    experts = moe.experts
    n = experts.num_experts
    tensors: list[torch.Tensor] = [t for _, t in sorted(experts.named_parameters()) if t.dim() >= 1 and t.shape[0] == n]
    if experts.int8 is not None:
        tensors += [t for pair in experts.int8 for t in pair]
    return tensors


def slot_bytes(moe: MoE) -> int:
    """Bytes of one slot (the same for every slot of a layer): what moving it costs."""
    return sum(t[0].numel() * t.element_size() for t in slot_tensors(moe))


def _pack(tensors: list[torch.Tensor], slot: int) -> torch.Tensor:
    return torch.cat([t.data[slot].reshape(-1).view(torch.uint8) for t in tensors])


def stage_layer(moe: MoE, changes: list[SlotChange], group: RankGroup) -> StagedLayer:
    """One collective on every rank of `group` (all must call it with the same `changes`, one layer's): send the
    slots this rank is the source of, receive the ones it is the destination of. → what this rank received."""
    dispatch = moe.dispatch
    assert dispatch is not None, "expert moves need expert parallelism"
    me, world = group.rank, group.world
    tensors = slot_tensors(moe)
    width = slot_bytes(moe)
    # canonical order on both sides: by (src, dst, slot), so a receiver reads rows in the order senders wrote them
    ordered = sorted(changes, key=lambda c: (c.src, c.dst, c.slot))
    outgoing = [c for c in ordered if c.src == me]  # grouped by dst in rank order (sorted above)
    incoming = [c for c in ordered if c.dst == me]  # grouped by src in rank order
    here = dict(((e, s) for s, e in enumerate(dispatch.ranks[me])))  # logical expert → this rank's slot
    device = tensors[0].device
    send = (
        torch.stack([_pack(tensors, here[c.expert]) for c in outgoing])
        if outgoing
        else torch.empty(0, width, dtype=torch.uint8, device=device)
    )
    send_splits = [sum(c.dst == r for c in outgoing) for r in range(world)]
    recv_splits = [sum(c.src == r for c in incoming) for r in range(world)]
    recv = torch.empty(len(incoming), width, dtype=torch.uint8, device=device)
    group.all_to_all(recv, send, recv_splits, send_splits)
    return StagedLayer([c.slot for c in incoming], recv)


def swap_layer(moe: MoE, staged: StagedLayer, ranks: list[list[int]]) -> None:
    """Put the staged slots in place and switch the layer to the placement `ranks` (every rank's slots, as
    staged). Between steps only: the layer must not be computing."""
    dispatch = moe.dispatch
    assert dispatch is not None, "expert moves need expert parallelism"
    tensors = slot_tensors(moe)
    sizes = [t[0].numel() * t.element_size() for t in tensors]
    with torch.no_grad():
        for slot, row in zip(staged.slots, staged.rows, strict=True):
            for t, part in zip(tensors, row.split(sizes), strict=True):
                t.data[slot].copy_(part.view(t.dtype).view(t.shape[1:]))
    mine = ranks[dispatch.group.rank]
    moe.experts.slots = list(mine)
    dispatch.set_placement(ranks)
    moe.experts.weights_changed()
