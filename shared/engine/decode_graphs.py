"""Decode steps replayed from graphs captured once at start, over static input buffers.

A decode-only step is the same program every time but for the batch size: the model over one token per
sequence, attention through the Triton decode kernel, the fused MoE, the logits of every row. Captured once
per batch-size bucket (`bucket_sizes`), a step of n sequences copies its inputs into the static buffers of
the smallest bucket b >= n and replays: one launch of the whole graph instead of a few hundred kernel
launches from Python. Shapes (legend): b rows of the bucket, n real rows, NBmax = cdiv(max_model_len, B)
block-table columns, V vocabulary.

Static buffers (one set, sized for the largest bucket; bucket b uses the first b rows, so every graph reads
the same addresses): `ints` (4, bmax) int64 = input ids, positions, slot of each row's new K/V, context
lengths; `tables` (bmax, NBmax) int64 block tables padded to max_model_len. Rows n..b-1 are padding: token 0
at position 0, its K/V written to the *scratch block* (one pool block the block manager never hands out) and
attending over that 1-token context, so a padded row touches no request's KV and yields finite logits that
nobody reads. Table columns past a sequence's own blocks also name the scratch block (the kernel never reads
them: it walks cdiv(context_len, B) blocks).

What keeps a step capturable: no host read anywhere in the forward (the Triton paths read none; the torch
path's `counts.tolist()` would), and every launch grid fixed by shapes and host ints: the decode kernel's
split count is chosen from max_model_len (`KernelDecodes.max_context_len`), not from the step's longest
context; fused_moe's grid is its shape-only bound `max_blocks`.

How a step is captured is a `GraphBackend`: `CudaGraphs` (torch.cuda.CUDAGraph, one memory pool shared by all
buckets, captured largest first so the smaller ones reuse its blocks) or `EagerReplay` (CPU, tests: "capture"
keeps the callable, "replay" runs it again over whatever the buffers hold), so the static-buffer program is
the same code on both and is proven on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.model.kernels.choice import KernelChoice
from shared.model.paged_attention import AttentionMetadata, KernelDecodes
from shared.model.transformer import CausalLM

# Powers of two up to 8, then every multiple of 8 (vLLM's choice too): a batch pads by at most 7 rows past 8
# (a padded row costs a fraction of a real one: it reads one KV block), and buckets stay few (12 at 64 seqs).
SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8

Replay = Callable[[], torch.Tensor]


class GraphBackend(Protocol):
    """How a step over static buffers is captured. `capture(fn)` returns a replay: it reruns what fn did, on
    whatever the buffers hold then, and returns fn's output (the same tensor each time on CUDA)."""

    name: str

    def capture(self, fn: Replay) -> Replay: ...

    def memory_bytes(self) -> int | None:
        """Device memory in use now (to measure what capture took); None where it is not measured."""
        ...


class EagerReplay:
    """The CPU stand-in for graphs: capture runs fn once (as a capture's warm-up would) and keeps it."""

    name = "eager replay (CPU)"

    def capture(self, fn: Replay) -> Replay:
        fn()
        return fn

    def memory_bytes(self) -> int | None:
        return None


class CudaGraphs:
    """torch.cuda.CUDAGraph per bucket, all in one private memory pool."""

    name = "CUDA graphs"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Replay) -> Replay:
        # Warm-up on a side stream (as torch.cuda.graph's docs ask): Triton compiles, cuBLAS picks its
        # workspace, the allocator settles, all outside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def memory_bytes(self) -> int | None:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, 16, 24, ... up to and including max_num_seqs."""
    sizes = [s for s in SMALL_BUCKETS if s < max_num_seqs]
    sizes += range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return sorted({*sizes, max_num_seqs})


def choose_backend(enabled: bool, device: torch.device, kernels: KernelChoice) -> tuple[GraphBackend | None, str]:
    """The backend the settings give, or None and why graphs are off."""
    if not enabled:
        return None, "off (cuda_graphs setting)"
    if device.type != "cuda":
        return None, f"off (device {device}: CUDA graphs need CUDA)"
    if kernels is not KernelChoice.TRITON:
        return None, f"off (kernels {kernels}: graphs capture the Triton path only)"
    return CudaGraphs(device), ""


@dataclass(frozen=True)
class CaptureReport:
    backend: str
    sizes: list[int]
    seconds: float
    memory_bytes: int | None  # device memory the graphs and their buffers took; None off CUDA

    def summary(self) -> str:
        memory = "memory not measured" if self.memory_bytes is None else f"{self.memory_bytes / 2**20:.1f} MiB"
        return (
            f"decode graphs: {len(self.sizes)} buckets {self.sizes} captured in {self.seconds:.2f} s, "
            f"{memory} ({self.backend})"
        )


class DecodeGraphs:
    """One captured decode step per bucket over shared static buffers. `capture()` once, after the KV pool
    exists (the graphs hold its address); then `run(...)` per decode-only step that `fits`."""

    def __init__(
        self,
        model: CausalLM,
        caches: list[torch.Tensor],
        block_size: int,
        scratch_block: int,
        max_model_len: int,
        sizes: list[int],
        backend: GraphBackend,
    ) -> None:
        if model.kernels is not KernelChoice.TRITON:
            raise ValueError(f"decode graphs need kernels=triton (the model runs {model.kernels})")
        self.model, self.caches, self.backend = model, caches, backend
        self.block_size, self.scratch_block, self.max_model_len = block_size, scratch_block, max_model_len
        self.sizes = sorted(sizes)
        self.nb_max = -(-max_model_len // block_size)
        device = caches[0].device
        self.ints = torch.zeros(4, self.sizes[-1], dtype=torch.int64, device=device)
        self.tables = torch.zeros(self.sizes[-1], self.nb_max, dtype=torch.int64, device=device)
        self._replays: dict[int, Replay] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self) -> CaptureReport:
        """Capture every bucket, largest first, with every row padding (so capture writes only the scratch
        block). Returns what it took."""
        started, before = time.perf_counter(), self.backend.memory_bytes()
        self._stage([], [], [], [], self.max_batch)
        for b in reversed(self.sizes):
            self._replays[b] = self.backend.capture(self._step_fn(b))
        after = self.backend.memory_bytes()
        memory = None if before is None or after is None else after - before
        return CaptureReport(self.backend.name, self.sizes, time.perf_counter() - started, memory)

    def _step_fn(self, b: int) -> Replay:
        """The step of bucket b over the first b rows of the static buffers: → logits (b, V) float32."""
        ids, positions, slots, lens = self.ints[:, :b]
        # max_context_len = max_model_len: the decode kernel's split count is the same every replay
        meta = AttentionMetadata(slots, b, [], [], KernelDecodes(self.tables[:b], lens, self.max_model_len))

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return self.model.logits(self.model(ids, positions, self.caches, meta))

        return step

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n rows; None when n exceeds the largest."""
        return next((b for b in self.sizes if b >= n), None)

    def fits(self, query_lens: list[int]) -> bool:
        """A step replays when every sequence brings one token and the batch fits a bucket."""
        return bool(query_lens) and len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)

    def run(self, block_tables: list[list[int]], context_lens: list[int], input_ids: list[int]) -> torch.Tensor:
        """One decode step of n = len(input_ids) sequences (context_lens include the new token) → logits (n, V)
        float32 of the real rows, a fresh tensor (the graph's output is overwritten by the next replay)."""
        n = len(input_ids)
        b = self.bucket_for(n)
        if b is None or b not in self._replays:
            raise ValueError(f"no captured bucket holds {n} rows (buckets {self.sizes}; capture() first)")
        self._stage(block_tables, context_lens, input_ids, [c - 1 for c in context_lens], b)
        return self._replays[b]()[:n].clone()

    def _stage(
        self, tables: list[list[int]], context_lens: list[int], ids: list[int], positions: list[int], b: int
    ) -> None:
        """Copy a step's inputs into the first b rows of the static buffers, rows past the real ones padded:
        two host → device copies."""
        bs, scratch, pad = self.block_size, self.scratch_block, b - len(ids)
        slots = [bt[p // bs] * bs + p % bs for bt, p in zip(tables, positions, strict=True)]
        ints = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [scratch * bs] * pad, context_lens + [1] * pad],
            dtype=torch.int64,
        )
        rows = [bt[: -(-n // bs)] for bt, n in zip(tables, context_lens, strict=True)]
        grid = torch.tensor([r + [scratch] * (self.nb_max - len(r)) for r in rows] + [[scratch] * self.nb_max] * pad)
        _upload(self.ints[:, :b], ints)
        _upload(self.tables[:b], grid.view(b, self.nb_max))


def _upload(dst: torch.Tensor, host: torch.Tensor) -> None:
    """One host → device copy into a static buffer. CUDA: from pinned memory, asynchronous (the caching host
    allocator keeps the pinned block until the copy has run; the replay after it is ordered on the stream)."""
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)
