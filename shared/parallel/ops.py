"""The op stream of a worker group: the leader tells its followers what to do to their model and KV pool.

Every change to a rank's KV pool is an op, so that with the same ops in the same order every follower's pool
stays what the leader's is (byte-identical while the models are replicated):

- `step`: one model step (shared/engine/step_inputs.py): the forward pass writes the step's KV;
- `copy`: one block copied onto another (a forked choice's own copy of a partial prompt block, fork.py);
- `write`: imported KV written into blocks, the data broadcast from the leader (a KV export the leader pulled);
  under data-parallel attention sent only to the rank whose blocks they are (the request's DP rank);
- `import_staged`: imported KV written into blocks from what each rank staged itself (agents.StagedKv: each
  rank pulled its own heads, nothing funnelled through the leader);
- `eplb_stage`: one sparse layer's changed expert slots sent between the ranks into spare buffers (live expert
  re-placement, eplb.py; the layer keeps serving from its current slots);
- `eplb_swap`: every staged layer switches to its new slots, on every rank at this point of the stream;
- `sync`: a barrier: the leader knows every follower has run every earlier op;
- `stop`: the follower's loop ends.

An op's header (a small tuple) goes over the follower's "ops" channel (channel.py); its data (the step's
packed inputs, imported KV) follows as tensors broadcast over the group, whose collectives time out. So a
follower idle between steps waits on its socket without limit (and sees its leader's death as a closed
socket), while a follower that dies or hangs mid-op makes the leader's broadcast raise within the timeout.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.engine.dp_step import block_rank, forward_rank_step, local_block
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVPool, PoolFill
from shared.engine.step_inputs import ScoredFn, StepInputs
from shared.model.expert_moves import StagedLayer, stage_layer, swap_layer
from shared.model.transformer import CausalLM
from shared.ranklink.agents import StagedExport, StagedKv
from shared.ranklink.channel import recv_frame, send_frame
from shared.sharding.group import LEADER, RankGroup
from shared.sharding.rebalance import layer_changes

log = logging.getLogger(__name__)


class RankGone(RuntimeError):
    """A follower's channel broke: the rank died; the group cannot go on."""


@dataclass
class BroadcastCost:
    """What broadcasting the step inputs has cost the leader: for the per-step overhead a group adds."""

    steps: int = 0
    seconds: float = 0.0
    bytes: int = 0

    @property
    def mean_us(self) -> float:
        return 1e6 * self.seconds / self.steps if self.steps else 0.0


@dataclass
class RankState:
    """What one rank's op stream acts on: its model, its pool (and its layer views), what it staged."""

    model: CausalLM
    pool: KVPool
    staged: StagedKv
    counts: Counter[str] = field(default_factory=Counter)  # ops executed, by kind
    # live expert re-placement: sparse layer → (its new placement, the slots this rank received), until the swap
    staged_experts: dict[int, tuple[list[list[int]], StagedLayer]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.caches = self.pool.layer_caches()
        self.device = self.pool.tensor.device
        # data-parallel attention: the ops' block ids are the group's global ids (shared/engine/dp_blocks.py),
        # and a rank writes only the blocks it holds, at their local ids
        group = self.model.dp_group
        self.dp: tuple[int, int] | None = None if group is None else (group.rank, group.world)

    def owner(self, blocks: list[int]) -> int | None:
        """The one rank that holds all of `blocks` under data-parallel attention (a request's blocks); None when
        every rank writes them (no DP attention, or blocks of several ranks)."""
        if self.dp is None or not blocks:
            return None
        world = self.dp[1]
        ranks = {block_rank(b, world) for b in blocks}
        return ranks.pop() if len(ranks) == 1 else None

    def _mine(self, blocks: list[int]) -> tuple[list[int], list[int]]:
        """(positions in `blocks` of this rank's blocks, their local ids); every block without DP attention."""
        if self.dp is None:
            return list(range(len(blocks))), blocks
        rank, world = self.dp
        at = [i for i, b in enumerate(blocks) if block_rank(b, world) == rank]
        return at, [local_block(blocks[i], world) for i in at]

    def step(self, inputs: StepInputs, on_scored: ScoredFn | None = None) -> torch.Tensor | None:
        self.counts["step"] += 1
        return forward_rank_step(self.model, self.caches, inputs, self.pool.layout.block_size, self.device, on_scored)

    def copy(self, src: int, dst: int) -> None:
        self.counts["copy"] += 1
        _, local = self._mine([src, dst])
        if len(local) == 2:  # a fork's copy stays on the parent's rank: both blocks here, or neither
            KVPool.copy_block(self.pool, *local)

    def write(self, blocks: list[int], data: torch.Tensor) -> None:
        self.counts["write"] += 1
        at, local = self._mine(blocks)
        if at:  # data (L, P, n, B, ...): this rank's blocks' rows (all of them without DP attention)
            KVPool.write(self.pool, local, data if len(at) == len(blocks) else data[:, :, at])

    def import_staged(self, key: str, blocks: list[int]) -> None:
        self.counts["import_staged"] += 1
        _, local = self._mine(blocks)
        if len(local) < len(blocks):  # another DP rank's request (its blocks all lie there): nothing pulled here
            self.staged.drop(key)
            return
        KVPool.write_export(self.pool, local, self.staged.take(key))

    def stage_experts(self, group: RankGroup, layer: int, ranks: list[list[int]]) -> None:
        """One collective: `layer`'s slots that `ranks` changes, sent and received (expert_moves.stage_layer)."""
        self.counts["eplb_stage"] += 1
        moe = self.model.sparse_layers()[layer]
        assert moe.dispatch is not None
        changes = layer_changes(layer, moe.dispatch.ranks, ranks)
        self.staged_experts[layer] = (ranks, stage_layer(moe, changes, group))

    def swap_experts(self) -> None:
        """Every staged layer takes its new placement (no collective: every rank runs it at the same op)."""
        self.counts["eplb_swap"] += 1
        layers = self.model.sparse_layers()
        for layer, (ranks, staged) in sorted(self.staged_experts.items()):
            swap_layer(layers[layer], staged, ranks)
        self.staged_experts.clear()


class StepBoundary(Protocol):
    """What runs at the leader's step boundaries (live expert re-placement, eplb.py ExpertRebalancer): before a
    step is announced (it may send ops of its own), and after the step ran here."""

    def between_steps(self, ops: LeaderOps) -> None: ...

    def after_step(self) -> None: ...


class LeaderOps:
    """The leader's end: each op is announced to every follower, its data broadcast, then run here too."""

    def __init__(self, group: RankGroup, channels: list[socket.socket], state: RankState) -> None:
        self.group = group
        self._channels = channels  # follower rank r at index r - 1
        self.state = state
        self.cost = BroadcastCost()
        self.rebalancer: StepBoundary | None = None  # live expert re-placement (--eplb): at step boundaries

    def _announce(self, header: tuple) -> None:
        for rank, sock in enumerate(self._channels, start=1):
            try:
                send_frame(sock, header)
            except OSError as exc:
                raise RankGone(f"rank {rank} of the worker group is gone ({exc!r}): the group stops") from exc

    def step(self, inputs: StepInputs, on_scored: ScoredFn) -> torch.Tensor | None:
        if self.rebalancer is not None:  # a step boundary: a move's next op runs before this step on every rank
            self.rebalancer.between_steps(self)
        start = time.perf_counter()
        sizes, flat = inputs.pack()
        self._announce(("step", sizes))
        self.group.broadcast_(flat.to(self.state.device))
        self.cost.steps += 1
        self.cost.bytes += flat.numel() * 8
        self.cost.seconds += time.perf_counter() - start
        out = self.state.step(inputs, on_scored)
        if self.rebalancer is not None:
            self.rebalancer.after_step()
        return out

    def stage_experts(self, layer: int, ranks: list[list[int]]) -> None:
        self._announce(("eplb_stage", layer, ranks))
        self.state.stage_experts(self.group, layer, ranks)

    def swap_experts(self) -> None:
        self._announce(("eplb_swap",))
        self.state.swap_experts()

    def copy(self, src: int, dst: int) -> None:
        self._announce(("copy", src, dst))
        self.state.copy(src, dst)

    def write(self, blocks: list[int], data: torch.Tensor) -> None:
        data = data.to(device=self.state.device, dtype=self.state.pool.tensor.dtype).contiguous()
        self._announce(("write", blocks, tuple(data.shape)))
        owner = self.state.owner(blocks)
        if owner is None:  # every rank writes (its own blocks of) them
            self.group.broadcast_(data)
        elif owner != self.group.rank:  # data-parallel attention: one rank holds them, only it receives the data
            self.group.send(data, owner)
        self.state.write(blocks, data)

    def import_staged(self, key: str, blocks: list[int]) -> None:
        self._announce(("import_staged", key, blocks))
        self.state.import_staged(key, blocks)

    def sync(self) -> None:
        """Returns once every follower has run every op sent before (followers run ops asynchronously to the
        leader): before reading a follower's pool through its agent, e.g. blocks the last step wrote."""
        self._announce(("sync",))
        self.group.barrier()

    def stop(self) -> None:
        """Ends every follower's loop; a follower already gone is not an error here."""
        for sock in self._channels:
            try:
                send_frame(sock, ("stop",))
            except OSError:
                pass


class MirroredKVPool(KVPool):
    """The leader's pool in a group: the same tensor, but every change outside a model step goes through the
    op stream, so the followers make it too."""

    def __init__(self, pool: KVPool, ops: LeaderOps) -> None:  # adopts `pool`'s tensor, allocates nothing
        self.layout, self.num_blocks, self.tensor = pool.layout, pool.num_blocks, pool.tensor
        self.memory = pool.memory  # None: a group's pools are never shared (kv_cache.share_pool)
        self.ops = ops

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.ops.write(block_ids, data)

    def write_export(self, block_ids: list[int], kv: PoolFill) -> None:
        if isinstance(kv, StagedExport):
            self.ops.import_staged(kv.key, block_ids)
        elif isinstance(kv, KVExport):  # a borrowed one too: gathered, then one write op for every rank
            self.ops.write(block_ids, kv.reblock(self.layout.block_size))
        else:
            kv.write_into(self, block_ids)  # through self.write: every rank

    def copy_block(self, src: int, dst: int) -> None:
        self.ops.copy(src, dst)


@torch.inference_mode()
def follow(
    group: RankGroup, channel: socket.socket, state: RankState, on_op: Callable[[str], None] | None = None
) -> str:
    """A follower's step loop: receive the leader's next op, run it, until `stop` or the leader's death.
    → why it ended ("stop" or "leader gone"). A failed op raises (the process exits; the leader's next
    collective with it fails)."""
    while True:
        header = recv_frame(channel)  # no timeout: idle is fine; a dead leader closes the socket
        if header is None:
            return "leader gone"
        kind = header[0]
        if kind == "stop":
            return "stop"
        if kind == "step":
            sizes = header[1]
            flat = torch.empty(StepInputs.packed_len(sizes), dtype=torch.int64, device=state.device)
            group.broadcast_(flat)
            state.step(StepInputs.unpack(sizes, flat.cpu()))
        elif kind == "copy":
            state.copy(header[1], header[2])
        elif kind == "write":
            owner = state.owner(header[1])
            if owner is None or owner == group.rank:
                data = torch.empty(header[2], dtype=state.pool.tensor.dtype, device=state.device)
                if owner is None:
                    group.broadcast_(data)
                else:
                    group.recv_(data, LEADER)
                state.write(header[1], data)
            else:
                state.counts["write"] += 1  # another rank's blocks: no data comes here
        elif kind == "import_staged":
            state.import_staged(header[1], header[2])
        elif kind == "eplb_stage":
            state.stage_experts(group, header[1], header[2])
        elif kind == "eplb_swap":
            state.swap_experts()
        elif kind == "sync":
            group.barrier()
        else:
            raise ValueError(f"unknown op {kind!r} from the leader")
        if on_op is not None:
            on_op(kind)
