"""Every matmul against a weight goes through `linear`, so the weight's storage format can change.

On CPU, oneDNN can reorder a weight once into its blocked layout ("prepacking"); matmuls against the
packed weight skip the per-call packing the default GEMM does, which dominates the small-M matmuls of
decode (8 tokens through one expert: ~3x faster here). Modules list their matmul weights in
`LINEAR_WEIGHTS`; `prepack(model)` gives each a packed twin the forward pass prefers. The plain
parameters stay (loading, the reference MoE path and tests use them), at the cost of a second copy.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works


@runtime_checkable
class WeightFormat(Protocol):
    """A matmul weight held in a format of its own (shared/model/int8.py's Int8Linear): it computes the product."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def linear(x: torch.Tensor, weight: torch.Tensor | WeightFormat, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T + bias. `weight` may be a packed oneDNN tensor, or a WeightFormat."""
    if not isinstance(weight, torch.Tensor):
        return weight.matmul(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs float32 on any x86 CPU; bfloat16 only where the CPU has the instructions for it
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: without them `_reorder_linear_weight` raises), else plain weights."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


@runtime_checkable
class Prepackable(Protocol):
    """A module that packs its own matmul weights: PackedWeights, or one with its own layout (experts.Experts)."""

    def prepack(self) -> None: ...


class PackedWeights:
    """Mixin for modules with matmul weights: `self.w(name)` is the weight in its serving format (int8 for a
    kernel, shared/model/int8.py), else the packed twin when there is one, else the parameter."""

    LINEAR_WEIGHTS: tuple[str, ...] = ()
    # the matmul weights load-time int8 quantization covers; None = all of LINEAR_WEIGHTS
    INT8_WEIGHTS: tuple[str, ...] | None = None

    def w(self, name: str) -> torch.Tensor | WeightFormat:
        formats = self.__dict__.get("_formats")
        if formats is not None and name in formats:
            return formats[name]
        packed = self.__dict__.get("_packed")
        if packed is not None and name in packed:
            return packed[name]
        return _get(self, name)

    def plain_weight(self, name: str) -> torch.Tensor:
        """The parameter `name` (dotted), whatever format serves it."""
        return _get(self, name)

    def int8_weights(self) -> tuple[str, ...]:
        return self.LINEAR_WEIGHTS if self.INT8_WEIGHTS is None else self.INT8_WEIGHTS

    def panel_weights(self) -> tuple[str, ...]:
        """The float32 weights the CPU panel linear may serve (shared/model/panel_linear.py): the int8 ones."""
        return self.int8_weights()

    def prepack(self) -> None:
        """oneDNN packs of the weights no other format serves."""
        served = self.__dict__.get("_formats") or {}
        self.__dict__["_packed"] = {name: pack(_get(self, name)) for name in self.LINEAR_WEIGHTS if name not in served}


def _get(module: object, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def prepack(model: nn.Module) -> int:
    """Pack every declared matmul weight of `model` for oneDNN; returns how many modules were packed."""
    if model.__dict__.get("prepacked"):
        return 0
    model.__dict__["prepacked"] = True
    count = 0
    for module in model.modules():
        if isinstance(module, Prepackable):
            module.prepack()
            count += 1
    return count
