"""One model step's flat inputs, and the one function that runs them: `forward_step`.

Everything the model calls of a step depend on is here, and nothing else: the token ids and positions, the
attention metadata's lists, the rows whose logits prompt scoring needs (prompt_scoring.py) and the sampling
rows. A worker group's leader builds them from its plan and its followers receive them (shared/parallel/ops.py),
so every rank makes the same model calls, collective for collective; only the leader samples.

Packed for the wire as one int64 tensor: [ids | positions | context_lens | query_lens | table_lens |
tables (concatenated) | sample_rows | score (start, count) pairs], its section sizes in `sizes()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.engine.step_clock import StepClock
from shared.model.device import to_device
from shared.model.paged_attention import AttentionMetadata
from shared.model.transformer import CausalLM


@dataclass(frozen=True)
class StepInputs:
    input_ids: list[int]  # (T,) every scheduled token, sequence after sequence
    positions: list[int]  # (T,)
    block_tables: list[list[int]]  # per sequence
    context_lens: list[int]  # per sequence, this step's tokens included
    query_lens: list[int]  # per sequence: tokens this step
    sample_rows: list[int]  # flat rows whose logits are sampled (a sequence's last row), in order
    score_rows: list[tuple[int, int]]  # (first row, count): the prompt-scoring logits calls, in order
    # KV cache groups after the first (shared/engine/kv_groups.py), in group order: (the group's window, per
    # sequence its block table there). Empty with one group (a hybrid model on a worker group keeps one pool:
    # grouped steps are not packed).
    group_tables: tuple[tuple[int, list[list[int]]], ...] = ()

    def sizes(self) -> tuple[int, int, int, int, int]:
        """(tokens, sequences, block-table entries, sampling rows, scoring calls): the packed sections' sizes."""
        entries = sum(map(len, self.block_tables))
        return len(self.input_ids), len(self.query_lens), entries, len(self.sample_rows), len(self.score_rows)

    def pack(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """(header sizes, one int64 tensor): what a follower needs to rebuild these inputs with `unpack`."""
        if self.group_tables:
            raise ValueError("a step over several KV cache groups is not sent to a worker group's followers")
        flat = (
            self.input_ids
            + self.positions
            + self.context_lens
            + self.query_lens
            + [len(t) for t in self.block_tables]
            + [b for t in self.block_tables for b in t]
            + self.sample_rows
            + [x for pair in self.score_rows for x in pair]
        )
        return self.sizes(), torch.tensor(flat, dtype=torch.int64)

    @staticmethod
    def packed_len(header: Sequence[int]) -> int:
        t, s, entries, samples, scores = header
        return 2 * t + 3 * s + entries + samples + 2 * scores

    @classmethod
    def unpack(cls, header: Sequence[int], flat: torch.Tensor) -> StepInputs:
        t, s, _, samples, scores = header
        values: list[int] = flat.tolist()
        at = 0

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n : at]

        ids, pos, ctx, q, lens = take(t), take(t), take(s), take(s), take(s)
        tables = [take(n) for n in lens]
        rows = take(samples)
        pairs = take(2 * scores)
        return cls(ids, pos, tables, ctx, q, rows, list(zip(pairs[::2], pairs[1::2], strict=True)))


ScoredFn = Callable[[int, torch.Tensor], None]  # (index into score_rows, its (count, V) logits)


def forward_step(
    model: CausalLM,
    caches: list[torch.Tensor],
    inputs: StepInputs,
    block_size: int,
    device: torch.device,
    on_scored: ScoredFn | None = None,
    clock: StepClock | None = None,
) -> torch.Tensor | None:
    """Run one step's model calls: the forward pass over the paged cache (writing this step's KV), one logits
    call per scoring slice (handed to `on_scored`, so a long prompt's logits are never all held at once), and
    the sampling rows' logits. → (S, V) float32 logits of the sampling rows, None if none. Every rank of a
    group calls this with the same inputs. `caches`: per layer, its view of its KV cache group's pool. `clock`:
    stamps the metadata and model phases (step_clock.py)."""
    staged = stage_step(model, inputs, block_size, device)
    if clock is not None:
        clock.mark("metadata")
    return run_staged(model, caches, inputs, staged, device, on_scored)


@dataclass
class StagedStep:
    """A step's inputs made ready for the model, on the host thread that plans (overlap scheduling builds the next
    step's while the current one runs): the attention metadata, and ids + positions + sampling rows in one host
    tensor, whose id entries a step launched before its inputs' last tokens were sampled gets written in later."""

    meta: AttentionMetadata
    host: torch.Tensor  # (2T + S,) int64: [ids | positions | sample_rows]


def stage_step(model: CausalLM, inputs: StepInputs, block_size: int, device: torch.device) -> StagedStep:
    meta = AttentionMetadata.build(
        block_tables=inputs.block_tables,
        context_lens=inputs.context_lens,
        query_lens=inputs.query_lens,
        block_size=block_size,
        device=device,
        kernels=model.kernels,
        windows=model.config.windows,
        full=model.config.has_full_layers,
        window_tables=dict(inputs.group_tables),
        cpu_decode_kernel=model.cpu_attention,
    )
    host = torch.tensor(inputs.input_ids + inputs.positions + inputs.sample_rows, dtype=torch.int64)
    return StagedStep(meta, host)


def run_staged(
    model: CausalLM,
    caches: list[torch.Tensor],
    inputs: StepInputs,
    staged: StagedStep,
    device: torch.device,
    on_scored: ScoredFn | None = None,
) -> torch.Tensor | None:
    """The model calls of `forward_step` over inputs `stage_step` made ready."""
    t = len(inputs.input_ids)
    ids, pos, rows = to_device(staged.host, device).split([t, t, len(inputs.sample_rows)])
    hidden = model(ids, pos, caches, staged.meta)
    for i, (first, count) in enumerate(inputs.score_rows):
        logits = model.logits(hidden[first : first + count])
        if on_scored is not None:
            on_scored(i, logits)
    if not inputs.sample_rows:
        return None
    if inputs.sample_rows == list(range(t)):  # every row samples (a decode-only step): no gather to make
        return model.logits(hidden)
    return model.logits(hidden[rows])  # (S, V) float32, on the device
