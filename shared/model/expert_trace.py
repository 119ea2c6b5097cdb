"""Which experts each request's tokens were routed to, in the steps that ask (decode routed by expert affinity:
shared/engine/request_experts.py arms it for the prompts whose summary a hand-off carries).

Shape: a step's T tokens belong to rows (one per traced request in the step, plus a last row for every other token,
counted and dropped: the index_add needs somewhere to put them). Each sparse layer adds its router's (T, A) choices
into one (rows + 1, L, E) int64 tensor on the model's device; `take` reads it once after the step. Unarmed (every
step of an engine that traces nothing, every decode-only step, CUDA graph capture), `add` does nothing.
"""

from __future__ import annotations

import torch


class ExpertTrace:
    """The per-row expert counts of one step, shared by every sparse layer of a model (MoE.trace)."""

    def __init__(self, layers: list[int], num_experts: int) -> None:
        self.index = {layer: i for i, layer in enumerate(layers)}  # sparse layer → its plane of the counts
        self.layers, self.num_experts = layers, num_experts
        self._owner: torch.Tensor | None = None  # (T,) each token's row; None: unarmed
        self._counts: torch.Tensor | None = None  # (rows + 1, L, E)

    @property
    def armed(self) -> bool:
        return self._owner is not None

    def arm(self, owner: list[int], rows: int, device: torch.device) -> None:
        """Count the next step: token i belongs to row owner[i] (in [0, rows]; row `rows` is dropped)."""
        self._owner = torch.tensor(owner, dtype=torch.int64, device=device)
        self._counts = torch.zeros(rows + 1, len(self.layers), self.num_experts, dtype=torch.int64, device=device)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """A sparse layer's routing of the step's tokens, ids (T, A) logical experts."""
        if self._owner is None or self._counts is None:
            return
        plane = (self._owner * len(self.layers) + self.index[layer]) * self.num_experts  # (T,)
        flat = (plane.unsqueeze(1) + ids).flatten()
        self._counts.view(-1).index_add_(0, flat, torch.ones_like(flat))

    def take(self) -> torch.Tensor:
        """→ (rows, L, E) on the host (the dropped row left out); disarms."""
        assert self._counts is not None, "take() after arm()"
        counts = self._counts[:-1].cpu()
        self._owner = self._counts = None
        return counts
