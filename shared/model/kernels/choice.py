"""Which implementation runs the model's hot ops: the plain-torch path or the Triton kernels.

Torch-free at import (the engine's configuration names the enum; shared/engine/config.py): triton is imported
only when a choice is resolved for a CUDA device or when a kernel actually runs.
"""

from __future__ import annotations

import importlib.util
import os
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class KernelChoice(StrEnum):
    """auto: triton on CUDA when triton is installed, else torch. torch: the plain-torch path (the CPU path,
    and the reference the kernels are tested against). triton: paged decode attention and the fused MoE
    kernels (shared/model/kernels/); on CPU only under TRITON_INTERPRET=1 (tests)."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


def resolve_kernels(choice: KernelChoice, device: torch.device, block_size: int) -> KernelChoice:
    """The concrete choice (TORCH or TRITON) for a model on `device` with a KV pool of `block_size` tokens per
    block. Raises ValueError for triton where the kernels cannot run: triton missing, a block size that is not
    a power of two (the decode kernel's tile), or a non-CUDA device without TRITON_INTERPRET=1 on CPU."""
    choice = KernelChoice(choice)  # a plain string from a caller that skipped the config's parsing
    triton_installed = importlib.util.find_spec("triton") is not None
    pow2 = block_size & (block_size - 1) == 0
    if choice is KernelChoice.AUTO:
        return KernelChoice.TRITON if device.type == "cuda" and triton_installed and pow2 else KernelChoice.TORCH
    if choice is KernelChoice.TRITON:
        if not triton_installed:
            raise ValueError("kernels=triton but triton is not installed")
        if not pow2:
            raise ValueError(f"kernels=triton needs a power-of-two block_size, got {block_size}")
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f"kernels=triton needs a CUDA device (or cpu with TRITON_INTERPRET=1 set before triton is "
                f"imported, for tests); the model is on {device}"
            )
    return choice
