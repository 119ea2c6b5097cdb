"""Constrained decoding inside the engine: one grammar matcher per constrained request, and each step's token
bitmask applied to the logits on their device, in one batched op, before sampling (rows without a grammar are
untouched, so greedy and sampled tokens alike obey it).

Off the critical path: a step's masks depend only on the tokens accepted before it, so `begin` hands the fill to
a thread (llguidance's own pool, GIL released) as the step starts, and `apply` collects it after the forward
pass. A matcher is made when the request enters the engine and replays the output it already has (a decode
worker after the KV hand-off, a worker a request migrated to), so every engine masks the same way at the same
position.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from shared.structured.grammar import Grammars, bitmask_words
from shared.structured.spec import StructuredSpec


@dataclass
class PendingMasks:
    """One step's masks being filled: rows (indices into the step's sampling rows) that have a grammar."""

    rows: list[int]
    bitmask: torch.Tensor  # (len(rows), words) int32, CPU
    done: Future[None]


@dataclass
class MaskStats:
    """Time spent on masks, cumulative: waiting for the fill after the forward (what the step lost to it) and
    applying the mask on the device."""

    steps: int = 0
    rows: int = 0
    wait_s: float = 0.0
    apply_s: float = 0.0
    fill_s: float = 0.0  # in the thread, overlapping the forward


class StructuredDecoding:
    """The engine's matchers, by request id. `grammars` is built on first use (the model directory's tokenizer)."""

    def __init__(self, make_grammars: Callable[[], Grammars]) -> None:
        self._make_grammars = make_grammars
        self._grammars: Grammars | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.stats = MaskStats()

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = self._make_grammars()
        return self._grammars

    def add(self, request_id: str, spec: StructuredSpec | None, output_token_ids: Sequence[int]) -> None:
        """Start following a request (no-op without a spec). Raises ValueError (GrammarError) for a spec that does
        not compile or an output that does not follow it."""
        if spec is not None:
            self._matchers[request_id] = self.grammars.matcher(spec, output_token_ids)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> None:
        m = self._matchers.get(request_id)
        if m is not None:
            m.consume_token(token_id)  # a masked token always follows; an error state would mask all but EOS

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def begin(self, request_ids: Sequence[str]) -> PendingMasks | None:
        """Start filling the masks of the step's sampling rows (None when none has a grammar)."""
        if not self._matchers:  # no request has a grammar: nothing per row
            return None
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        grammars = self.grammars
        bitmask = torch.zeros((len(rows), bitmask_words(grammars.vocab_size)), dtype=torch.int32)
        matchers = [(self._matchers[request_ids[r]], j) for j, r in enumerate(rows)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return PendingMasks(rows, bitmask, self._pool.submit(self._fill, matchers, bitmask))

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.grammars.fill_masks(matchers, bitmask)
        self.stats.fill_s += time.perf_counter() - t0

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (S, V) with disallowed tokens at -inf in the grammar rows (in place; returned for chaining)."""
        if pending is None:
            return logits
        t0 = time.perf_counter()
        pending.done.result()
        t1 = time.perf_counter()
        apply_bitmask(logits, pending.bitmask, pending.rows)
        t2 = time.perf_counter()
        s = self.stats
        s.steps += 1
        s.rows += len(pending.rows)
        s.wait_s += t1 - t0
        s.apply_s += t2 - t1
        return logits

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set logits[rows[j], t] = -inf where bit t of bitmask[j] is 0: the bits unpacked on the logits' device and
    written with one masked index_put (ids past the bitmask's width are disallowed too)."""
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = bitmask.to(device, non_blocking=True)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()  # (R, words * 32)
    vocab = logits.shape[1]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = torch.zeros((len(rows), vocab - allowed.shape[1]), dtype=torch.bool, device=device)
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
