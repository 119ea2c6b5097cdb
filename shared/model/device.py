"""Where tensors live: the device a setting names, and the one way host-built tensors reach it.

Everything the forward pass touches lives on the model's device; what is built on the host each step
(token ids, positions, block tables, slot mappings) crosses once per step through `to_device`.
"""

from __future__ import annotations

import torch

# Device kinds the engine runs on; meta (tensors without data) serves the placement tests.
SUPPORTED = ("cpu", "cuda", "meta")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device a setting names, with its index filled in for CUDA (so `==` compares tensors'
    devices correctly). Raises ValueError for an unknown device, or CUDA where this process has none."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {str(name)!r}: choose cpu, cuda or cuda:N") from exc
    if device.type not in SUPPORTED:
        raise ValueError(f"unsupported device {str(name)!r}: choose cpu, cuda or cuda:N")
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"device {str(name)!r} requested but CUDA is not available (torch {torch.__version__}, {build})"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {str(name)!r} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    return torch.device("cuda", index)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """One copy of a host-built tensor to `device`. CUDA: staged in pinned memory and asynchronous (the
    caching host allocator keeps the pinned block until the copy has run), so the host moves on."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
