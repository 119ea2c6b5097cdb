"""The decode rows' block tables as one persistent host tensor, updated by diffs (vLLM's persistent batch).

A decode step's attention kernel (the CPU one, or Triton's) reads every decode sequence's block table from one
(Bd, NBmax) int64 tensor padded with block 0. Made from the requests' lists each step that is a nested list
padded and copied into a new tensor (~2 µs a sequence); here row i keeps the table of the step's i-th decode
between steps, and a step writes only what changed: the entries a table grew by (one block every block_size
steps), or the whole row when another table took the row (a request joined, left or was preempted).

Row i mirrors one list object (a request's `GroupTable.blocks`) by identity: the scheduler only ever appends
to a table (`extend`) or replaces it with a new list (release, import, fork), so an unchanged identity and
length mean an unchanged row. The exception, blocks freed behind a sliding window in place (FREED), is why the
runner keeps no DecodeTables for a model with windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DecodeTables:
    def __init__(self) -> None:
        self.table = torch.zeros((0, 0), dtype=torch.int64)  # (rows, width), 0 past each row's entries
        self._mirrors: list[list[int] | None] = []  # per row, the list it mirrors (held, so ids are not reused)
        self._written: list[int] = []  # per row, the entries of that list it holds
        self.rows_written = 0  # whole rows written (a counter for tests)

    def update(self, tables: Sequence[list[int]]) -> torch.Tensor:
        """`tables` (the step's decodes' block tables, in order) → (len(tables), longest) int64 host tensor, a view
        of the persistent table valid until the next update."""
        longest = max(map(len, tables), default=0)
        self._fit(len(tables), longest)
        table, mirrors, written = self.table, self._mirrors, self._written
        for i, blocks in enumerate(tables):
            have, n = written[i], len(blocks)
            if mirrors[i] is blocks and have <= n:
                if n > have:  # the table grew
                    table[i, have:n] = torch.tensor(blocks[have:], dtype=torch.int64)
            else:  # another table took the row
                if n:
                    table[i, :n] = torch.tensor(blocks, dtype=torch.int64)
                if have > n:
                    table[i, n:have] = 0
                mirrors[i] = blocks
                self.rows_written += 1
            written[i] = n
        return table[: len(tables), :longest]

    def _fit(self, rows: int, width: int) -> None:
        """Grow the table (doubling) to hold `rows` x `width`, its rows kept."""
        have_rows, have_width = self.table.shape
        if rows <= have_rows and width <= have_width:
            return
        rows, width = max(rows, 2 * have_rows), max(width, 2 * have_width)
        table = torch.zeros((rows, width), dtype=torch.int64)
        table[:have_rows, :have_width] = self.table
        self.table = table
        self._mirrors += [None] * (rows - have_rows)
        self._written += [0] * (rows - have_rows)
