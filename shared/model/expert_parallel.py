"""Expert parallelism: each rank of a worker group holds some of a sparse layer's experts (its slots, per an
ExpertPlacement: by default a contiguous 1/ep, or a planned placement with redundant replicas), and the
MoE block's routed-expert sum is computed across the ranks.

Invariant at the MoE input: every rank holds the same (T, D) hidden states (attention is replicated, or
tensor-parallel and all-reduced), and the router runs replicated over all T tokens (T x D x E: cheap), so
every rank computes the same routing. Consequences: the per-expert counters (MoE.expert_load) on every rank
already hold the group's totals (the leader's read is the group's, nothing to sum), and every rank can count
each rank's load (`rank_load`) without a collective.

Each (token, expert) pair is computed by exactly one replica of its expert: replica `token % replicas`
(global token index), so replicas split an expert's tokens evenly. Two ways to combine:

- allreduce (baseline): every rank computes its slots' pairs for all T tokens into a (T, D) partial sum,
  then one all-reduce.
- alltoall: rank r takes its ragged 1/R of the tokens, sends each pair's hidden row to the rank holding the
  chosen replica (all_to_all of the counts, then of the slot ids and rows), computes what it received,
  sends the results back (all_to_all), combines them weighted, and an all_gather of the token slices gives
  every rank the full (T, D) again.

Data-parallel attention (`data_parallel`, --dp-attention): the invariant above does not hold: each rank brings
its own T_r tokens (its own requests' rows, T_r = 0 for a rank with none this step), routed on that rank. The
combine is the all-to-all's with the rank's own tokens as its slice and no all-gather at the end: each rank gets
back its own tokens' routed sums. Every rank takes part in every layer's exchange, an empty one included (it
sends and receives counts, then nothing of its own: `idle`). The counts exchange carries every rank's per-rank
and per-expert counts too (`_exchange_counts`), so each rank's counters still hold the group's totals.

The all-to-all needs the split sizes on the host (one device read per layer on an accelerator, as in every
naive all-to-all dispatch); the counters never leave the device in the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup

if TYPE_CHECKING:
    from shared.model.experts import Experts


class ExpertParallel:
    """One sparse layer's expert-parallel state on one rank: where each logical expert's replicas are, the
    chosen combine, and the per-rank load counters (on the model's device)."""

    def __init__(
        self,
        group: RankGroup,
        ranks: list[list[int]],
        num_experts: int,
        mode: EPDispatch,
        data_parallel: bool = False,
    ) -> None:
        if len(ranks) != group.world:
            raise ValueError(f"placement has {len(ranks)} ranks, the group {group.world}")
        self.group, self.mode, self.num_experts = group, EPDispatch(mode), num_experts
        self.data_parallel = data_parallel  # each rank its own tokens (module doc): all-to-all, never skipped
        self.set_placement(ranks)
        # since the last take_rank_load: pairs each rank computed (R,), and Σ over forwards of the busiest
        # rank's pairs (the step waits for it): the imbalance is peak / (total / R)
        self.rank_load = torch.zeros(group.world, dtype=torch.int64)
        self.peak_load = torch.zeros((), dtype=torch.int64)
        # (E,) tokens routed to each logical expert since the group's live re-placement last took them, once a
        # step (shared/parallel/eplb.py; only the leader's are read: every rank routes alike)
        self.expert_tokens = torch.zeros(num_experts, dtype=torch.int64)
        # (E,) the group's tokens per logical expert in the last forward (MoE.expert_load adds it under
        # data-parallel attention, where this rank's router saw only its own tokens)
        self.routed = torch.zeros(num_experts, dtype=torch.int64)

    def set_placement(self, ranks: list[list[int]]) -> None:
        """Where each logical expert's replicas are: `ranks[r]` the experts of rank r's slots. At load, and when
        a live re-placement swaps in new slots (shared/model/expert_moves.py), between steps."""
        replicas: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for rank, slots in enumerate(ranks):
            for slot, expert in enumerate(slots):
                replicas[expert].append((rank, slot))
        # (E, most) tables, padded by repeating the first replica (never chosen: index < num_replicas); at least one
        # column per rank, so a live re-placement (at most one replica per rank) keeps their shape
        most = max(self.group.world, *(len(r) for r in replicas))
        rank = torch.tensor([[r for r, _ in rep] + [rep[0][0]] * (most - len(rep)) for rep in replicas])
        slot = torch.tensor([[s for _, s in rep] + [rep[0][1]] * (most - len(rep)) for rep in replicas])
        count = torch.tensor([len(rep) for rep in replicas])
        if hasattr(self, "_rank") and self._rank.shape == rank.shape:
            # a live re-placement: into the tables in place, so that what captured them (a CUDA graph) reads the new
            # placement
            for old, new in zip((self._rank, self._slot, self._count), (rank, slot, count), strict=True):
                old.copy_(new)
        else:
            device = self._rank.device if hasattr(self, "_rank") else None
            self._rank, self._slot, self._count = (t if device is None else t.to(device) for t in (rank, slot, count))
        self.ranks = [list(slots) for slots in ranks]
        self.num_slots = len(ranks[self.group.rank])

    def _on(self, device: torch.device) -> None:
        if self._rank.device != device:
            self._rank, self._slot, self._count = (t.to(device) for t in (self._rank, self._slot, self._count))
            self.rank_load, self.peak_load = self.rank_load.to(device), self.peak_load.to(device)
            self.expert_tokens = self.expert_tokens.to(device)

    def assign(self, ids: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (N, A) logical experts of tokens with global indices `token` (N,) → (rank, local slot) of the
        replica computing each pair, (N, A) each."""
        j = token.unsqueeze(1) % self._count[ids]
        return self._rank[ids, j], self._slot[ids, j]

    def forward(self, experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self._on(x.device)
        t = x.shape[0]
        if t == 0 and not self.data_parallel:  # every rank sees the same T: all skip the collectives together
            return torch.zeros_like(x)
        token = torch.arange(t, device=x.device)
        dest_rank, dest_slot = self.assign(ids, token)
        if self.data_parallel:  # this rank's own tokens out to the experts' ranks and back: nothing to gather
            return self._alltoall(experts, x, weights, dest_rank, dest_slot, own_ids=ids)
        per_rank = torch.zeros_like(self.rank_load).index_add_(0, dest_rank.flatten(), torch.ones_like(ids).flatten())
        routed = torch.zeros_like(self.expert_tokens).index_add_(0, ids.flatten(), torch.ones_like(ids).flatten())
        self._add_counts(per_rank, routed)
        if self.mode is EPDispatch.ALLREDUCE:
            return self._allreduce(experts, x, ids, weights, dest_rank, dest_slot)
        return self._alltoall(experts, x, weights, dest_rank, dest_slot)

    def _add_counts(self, per_rank: torch.Tensor, routed: torch.Tensor) -> None:
        """One forward's group-wide counts: pairs per computing rank (R,), tokens per logical expert (E,)."""
        self.rank_load += per_rank
        self.peak_load += per_rank.max()
        self.expert_tokens += routed
        self.routed = routed

    def idle(self, experts: Experts, hidden: int, dtype: torch.dtype, device: torch.device, top_k: int) -> None:
        """A data-parallel rank without tokens this step: its part of the layer's exchange (it computes the
        other ranks' pairs that its slots own, and counts the group's)."""
        x = torch.empty(0, hidden, dtype=dtype, device=device)
        ids = torch.empty(0, top_k, dtype=torch.int64, device=device)
        self.forward(experts, x, ids, torch.empty(0, top_k, dtype=torch.float32, device=device))

    def _compute(self, experts: Experts, rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """rows (N, D) each for local slot `slot` (N,) → the slot expert's output (N, D), unweighted."""
        if rows.shape[0] == 0:
            return rows.clone()
        counts = torch.zeros(self.num_slots, dtype=torch.int64, device=rows.device)
        counts.index_add_(0, slot, torch.ones_like(slot))
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return experts(rows, slot.unsqueeze(1), ones, counts)

    def _allreduce(self, experts, x, ids, weights, dest_rank, dest_slot) -> torch.Tensor:
        a = ids.shape[1]
        mine = (dest_rank.flatten() == self.group.rank).nonzero().squeeze(1)  # this rank's pairs
        token = mine // a
        y = self._compute(experts, x[token], dest_slot.flatten()[mine])
        w = weights.flatten()[mine].unsqueeze(1)
        out = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, w.dtype)).index_add_(0, token, y * w)
        out = out.to(x.dtype)  # summed in the routing weights' dtype, like the single-rank paths
        return self.group.all_reduce_(out)

    def _alltoall(self, experts, x, weights, dest_rank, dest_slot, own_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`own_ids` (T, A), the routing of this rank's own tokens (data-parallel attention): all of them go out,
        and their sums are the result; else this rank takes its 1/R slice of the replicated tokens, and
        all-gathers."""
        group, world = self.group, self.group.world
        own = own_ids is not None
        t, a = dest_rank.shape
        sizes = [t // world + (r < t % world) for r in range(world)]  # ragged token slices, in rank order
        lo = 0 if own else sum(sizes[: group.rank])
        hi = t if own else lo + sizes[group.rank]
        # this rank's pairs, sorted by the rank that computes them (stable: a token's pairs keep their order)
        flat_rank = dest_rank[lo:hi].flatten()
        order = flat_rank.argsort(stable=True)
        token = order // a  # within the slice
        send_rows = x[lo:hi][token]
        send_slot = dest_slot[lo:hi].flatten()[order]
        send = torch.zeros(world, dtype=torch.int64, device=x.device).index_add_(
            0, flat_rank, torch.ones_like(flat_rank)
        )
        if own_ids is None:
            recv = group.all_to_all(torch.empty_like(send), send, [1] * world, [1] * world)
        else:
            recv = self._exchange_counts(send, own_ids)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        n = sum(recv_splits)
        recv_slot = group.all_to_all(send_slot.new_empty(n), send_slot, recv_splits, send_splits)
        recv_rows = group.all_to_all(x.new_empty(n, x.shape[1]), send_rows, recv_splits, send_splits)
        y = self._compute(experts, recv_rows, recv_slot)
        back = group.all_to_all(torch.empty_like(send_rows), y, send_splits, recv_splits)
        w = weights[lo:hi].flatten()[order].unsqueeze(1)
        if own:  # summed in the routing weights' dtype, like the single-rank paths
            mine = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, w.dtype))
            return mine.index_add_(0, token, back * w).to(x.dtype)
        # padded to the largest slice: all_gather takes equal shapes; summed in the routing weights' dtype
        part = x.new_zeros(max(sizes), x.shape[1], dtype=torch.promote_types(x.dtype, w.dtype))
        part = part.index_add_(0, token, back * w).to(x.dtype)
        gathered = group.all_gather(part, dim=0)  # (R * max, D)
        keep = torch.cat(
            [torch.arange(r * max(sizes), r * max(sizes) + s, device=x.device) for r, s in enumerate(sizes)]
        )
        return gathered[keep]

    def _exchange_counts(self, send: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention's counts exchange, one all-to-all of small int rows: rank i sends rank j
        [its pairs for j | its pairs per rank (R) | its tokens per expert (E)], so besides the split sizes every
        rank learns every rank's counts and keeps the group's totals, as a replicated router would (the leader's
        counters are the group's). → the pairs each rank sends here (R,)."""
        world = self.group.world
        routed = torch.zeros_like(self.expert_tokens).index_add_(0, ids.flatten(), torch.ones_like(ids).flatten())
        header = torch.cat(
            [send.unsqueeze(1), send.unsqueeze(0).expand(world, -1), routed.unsqueeze(0).expand(world, -1)], dim=1
        )
        got = self.group.all_to_all(torch.empty_like(header), header, [1] * world, [1] * world)
        self._add_counts(got[:, 1 : 1 + world].sum(0), got[:, 1 + world :].sum(0))
        return got[:, 0].contiguous()


@dataclass(frozen=True)
class RankLoad:
    """Expert-parallel load since the last read, summed over the sparse layers."""

    per_rank: list[int]  # (token, expert) pairs each rank computed
    peak: int  # Σ over layer forwards of the busiest rank's pairs

    @property
    def imbalance(self) -> float:
        """The busiest rank's pairs over the mean rank's, weighted over the steps (1.0 = balanced)."""
        total = sum(self.per_rank)
        return self.peak * len(self.per_rank) / total if total else 1.0
