"""MXFP4 checkpoints (gpt-oss as published): expert weights in 4-bit floats with one power-of-two scale per 32.

Format (OCP microscaling, as transformers' integrations/mxfp4.py reads it): a weight W (..., R, K) is stored as
  `<name>_blocks` uint8 (..., R, K/32, 16): two FP4 E2M1 values per byte, the element at even k in the low nibble,
  `<name>_scales` uint8 (..., R, K/32): E8M0 exponents biased by 127, one per 32 consecutive k,
and W[..., r, k] = FP4[nibble] * 2 ** (scales[..., r, k // 32] - 127). gpt-oss stores its experts' weights that way
transposed: `mlp.experts.gate_up_proj_blocks` (E, 2I, D/32, 16) dequantizes to (E, 2I, D), the transpose of the
unquantized checkpoint's `gate_up_proj` (E, D, 2I); `down_proj_blocks` (E, D, I/32, 16) to `down_proj` (E, I, D).
They are dequantized to float32 at load (then cast to the compute dtype), into the tensor the unquantized
checkpoint would hold; everything after that (layout, slicing, tensor parallelism) is the plain path's.

`Mxfp4` has the shape of the loader's quantization methods (`companion_of`, `read` over a tensor source): the
scales are the blocks' companion, read with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# E2M1: sign bit, 2 exponent bits, 1 mantissa bit; index = the nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8, scales (..., G) uint8 → (..., G * 32) in `dtype` (exact: every FP4 value times
    a power of two is representable in float32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # (..., G, 16, 2)
    values = values.flatten(-2)  # (..., G, 32): low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (..., K), K a multiple of 32 → (blocks (..., K/32, 16), scales (..., K/32)), uint8 each: each group's
    scale the smallest power of two that brings its largest magnitude within FP4's 6, each value rounded to the
    nearest FP4 value. For tests and tools: what a published MXFP4 checkpoint holds."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"the last dimension ({weight.shape[-1]}) must be a multiple of {GROUP}")
    groups = weight.float().unflatten(-1, (-1, GROUP))  # (..., G, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)  # (..., G)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    nibbles = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # (..., G, 32)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8).contiguous()


class TensorSource(Protocol):
    """The checkpoint's tensors by name, across its files (the loader's)."""

    def __contains__(self, name: str) -> bool: ...
    def read(self, name: str, index: tuple = ()) -> torch.Tensor: ...


@dataclass(frozen=True)
class Mxfp4:
    """Reads `<w>_blocks` (with its companion `<w>_scales`) as the dequantized, transposed `<w>`: the tensor an
    unquantized gpt-oss checkpoint holds under that name. Other tensors are read as stored."""

    name: str = "mxfp4"

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> Mxfp4:
        del quantization_config  # modules_to_not_convert: the unquantized tensors are simply stored plain
        return cls()

    @staticmethod
    def weight_name(name: str) -> str:
        """The unquantized checkpoint's name for a `_blocks` tensor (others unchanged)."""
        return name.removesuffix("_blocks")

    def companion_of(self, name: str) -> str | None:
        return name.removesuffix("_scales") + "_blocks" if name.endswith("_scales") else None

    def read(self, tensors: TensorSource, name: str, index: tuple) -> torch.Tensor:
        if not name.endswith("_blocks"):
            return tensors.read(name, index)
        scales = name.removesuffix("_blocks") + "_scales"
        if scales not in tensors:
            raise ValueError(f"MXFP4 checkpoint: {name} has no {scales}")
        weight = dequantize_mxfp4(tensors.read(name), tensors.read(scales))  # (E, R, K)
        weight = weight.transpose(-1, -2)  # the unquantized layout (E, K, R)
        return weight[index] if index else weight
