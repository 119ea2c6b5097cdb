"""One step under data-parallel attention (--dp-attention): every rank runs the model over its own requests only.

The leader plans one step for the whole group, as for any worker group, and every rank receives the same
StepInputs (shared/parallel/ops.py). Under data-parallel attention the block ids in those inputs are global ids
of the group's partitioned pool (dp_blocks.py): global block g is local block g // R of rank g % R, and a request's
blocks all lie on one rank, its DP rank. So every rank can cut its own slice from the inputs, no message of its own:

- its sequences (those whose blocks are its own), their tokens, positions and local block tables: it runs the
  attention and dense layers over those only, over its own pool; the MoE layers exchange tokens between the
  ranks (shared/model/expert_parallel.py, `data_parallel`), and a rank without sequences this step still joins
  every layer's exchange (`CausalLM.idle_step`);
- the rows whose hidden states the logits need (sampling rows, prompt-scoring slices): each rank's own, padded to
  the largest rank's count and all-gathered, then put back in the step's order. Every rank then has the step's
  needed hidden rows and computes the same logits as one engine would (the LM head is replicated at tp = 1), so
  SPMD engines sample alike; in a leader-driven group only the leader's are used.

Shapes: T = the step's tokens (all ranks), T_r = rank r's, N = the needed rows, n_r = rank r's of them, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.block_manager import FREED
from shared.engine.step_clock import StepClock
from shared.engine.step_inputs import ScoredFn, StepInputs, forward_step, stage_step
from shared.model.device import to_device
from shared.model.transformer import CausalLM
from shared.sharding.group import RankGroup


def block_rank(block: int, world: int) -> int:
    """The DP rank that holds global block `block`."""
    return block % world


def local_block(block: int, world: int) -> int:
    """Global block `block`'s id in its rank's pool."""
    return block // world


def seq_rank(table: list[int], world: int) -> int:
    """The DP rank of a sequence: where its blocks are (all on one rank; FREED entries hold none)."""
    return block_rank(next(b for b in table if b != FREED), world)


@dataclass(frozen=True)
class DpSlice:
    """One rank's part of a step: its own inputs (local block ids, no sampling or scoring rows), and per rank
    which of the step's needed rows it holds: (index among the needed rows, its row in that rank's slice)."""

    inputs: StepInputs
    held: list[list[tuple[int, int]]]  # per rank r: (needed index, local row), in needed order
    num_needed: int

    @classmethod
    def of(cls, inputs: StepInputs, rank: int, world: int) -> DpSlice:
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        local_row: dict[int, tuple[int, int]] = {}  # global row → (rank, row in that rank's slice)
        filled = [0] * world
        start = 0
        for table, ctx, q in zip(inputs.block_tables, inputs.context_lens, inputs.query_lens, strict=True):
            owner = seq_rank(table, world)
            for k in range(q):
                local_row[start + k] = (owner, filled[owner] + k)
            filled[owner] += q
            if owner == rank:
                ids += inputs.input_ids[start : start + q]
                positions += inputs.positions[start : start + q]
                tables.append([b if b == FREED else local_block(b, world) for b in table])
                context_lens.append(ctx)
                query_lens.append(q)
            start += q
        needed = list(inputs.sample_rows) + [first + k for first, count in inputs.score_rows for k in range(count)]
        held: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for j, row in enumerate(needed):
            owner, row_there = local_row[row]
            held[owner].append((j, row_there))
        mine = StepInputs(ids, positions, tables, context_lens, query_lens, sample_rows=[], score_rows=[])
        return cls(mine, held, len(needed))


def forward_rank_step(
    model: CausalLM,
    caches: list[torch.Tensor],
    inputs: StepInputs,
    block_size: int,
    device: torch.device,
    on_scored: ScoredFn | None = None,
    clock: StepClock | None = None,
) -> torch.Tensor | None:
    """A rank's step: `forward_step`, or under data-parallel attention `forward_dp_step` (its own requests)."""
    if model.dp_group is not None:
        return forward_dp_step(model, model.dp_group, caches, inputs, block_size, device, on_scored)
    return forward_step(model, caches, inputs, block_size, device, on_scored, clock)


def forward_dp_step(
    model: CausalLM,
    group: RankGroup,
    caches: list[torch.Tensor],
    inputs: StepInputs,
    block_size: int,
    device: torch.device,
    on_scored: ScoredFn | None = None,
) -> torch.Tensor | None:
    """`forward_step` under data-parallel attention (module doc): the same result, the same collectives on every
    rank. → (S, V) float32 logits of the step's sampling rows, None if none."""
    world = group.world
    part = DpSlice.of(inputs, group.rank, world)
    if part.inputs.input_ids:
        staged = stage_step(model, part.inputs, block_size, device)
        hidden = model(*_ids_positions(staged.host, len(part.inputs.input_ids), device), caches, staged.meta)
    else:  # no sequence of this rank this step: its part of every MoE layer's exchange only
        model.idle_step(device)
        hidden = None
    if part.num_needed == 0:
        return None
    most = max(len(h) for h in part.held)
    mine = part.held[group.rank]
    dim = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    send = torch.zeros(most, dim, dtype=dtype, device=device)
    if mine:
        assert hidden is not None
        rows = torch.tensor([row for _, row in mine], dtype=torch.int64, device=device)
        send[: len(mine)] = hidden[rows]
    gathered = group.all_gather(send, dim=0)  # (R * most, D)
    order = torch.empty(part.num_needed, dtype=torch.int64)
    for r, held in enumerate(part.held):
        for k, (j, _) in enumerate(held):
            order[j] = r * most + k
    needed = gathered[order.to(device)]  # (N, D): sampling rows, then every scoring slice's rows
    # the leader's logits calls, as run_staged makes them over one engine's hidden states
    at = len(inputs.sample_rows)
    for i, (_, count) in enumerate(inputs.score_rows):
        logits = model.logits(needed[at : at + count])
        at += count
        if on_scored is not None:
            on_scored(i, logits)
    if not inputs.sample_rows:
        return None
    return model.logits(needed[: len(inputs.sample_rows)])


def _ids_positions(host: torch.Tensor, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The staged host tensor's ids and positions (it holds no sampling rows: the slice samples none)."""
    ids, pos = to_device(host, device).split([t, t])
    return ids, pos
