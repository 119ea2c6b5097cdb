"""Transfer memory reused across pulls: receive buffers (decode side) and export buffers (prefill side).

A fresh CPU tensor pays a page fault per 4 KiB page on first touch; on the development machine that
costs as long as the gloo transfer that fills it. Buffers handed back once their transfer is over are
kept (up to a byte cap) and lent again, viewed in the shape the next pull needs. Not thread-safe: a
caller that uses one pool from two threads serializes the calls.
"""

from __future__ import annotations

import math
import weakref

import torch


class BufferPool:
    def __init__(self, max_cached_bytes: int, device: str) -> None:
        if max_cached_bytes < 0:
            raise ValueError(f"max_cached_bytes must be >= 0, got {max_cached_bytes}")
        self.max_cached_bytes = max_cached_bytes
        self.device = device
        self._free: list[torch.Tensor] = []  # flat 1-D buffers, each its own storage
        # Flat buffers out on loan, by storage address; an entry vanishes if the borrower drops it.
        self._lent: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    @property
    def cached_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._free)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape`: a view of the smallest cached buffer that fits, else new."""
        numel = math.prod(shape)
        fits = [t for t in self._free if t.dtype == dtype and t.numel() >= numel]
        if fits:
            flat = min(fits, key=lambda t: t.numel())
            self._free = [t for t in self._free if t is not flat]
        else:
            flat = torch.empty(numel, dtype=dtype, device=self.device)
        self._lent[flat.untyped_storage().data_ptr()] = flat
        return flat[:numel].view(shape)  # keeps `flat` alive as its base

    def give_back(self, tensor: torch.Tensor) -> bool:
        """Keep the buffer under a tensor from `take` for reuse; nobody may touch the tensor afterwards.
        False, and nothing kept, for a tensor not on loan (given back twice, or not ours) or past the cap."""
        flat = self._lent.pop(tensor.untyped_storage().data_ptr(), None)
        if flat is None or self.cached_bytes + flat.untyped_storage().nbytes() > self.max_cached_bytes:
            return False
        self._free.append(flat)
        return True
