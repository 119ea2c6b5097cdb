"""Quantized checkpoints: which `quantization_config`s load, and how their tensors become compute-dtype weights.

A checkpoint's `quantization_config.quant_method` selects a `QuantMethod` from `QUANT_METHODS` (a registry:
`register("mxfp4")(factory)` plugs another in); any other method is refused by name. The loader asks the method
for every checkpoint tensor: `companion_of(name)` (for a scale: the weight whose `read` consumes it) and
`read(tensors, name, source)` (the tensor dequantized to float32, or only the slice `source` a tensor-parallel
rank reads). Without a quantization config, `PLAIN` reads tensors as they are and refuses the tensors that would
mean the weights are not what they seem (a float8 weight, a `*_scale_inv` / `*_scale` tensor).

Methods made at load from a float checkpoint (`LOAD_METHODS`, chosen by the engine's `quantization` setting, not by
the checkpoint): `int8` and its twin `int8_dequantized` (shared/model/int8.py), applied to the loaded model
(`LoadMethod.apply`); `load_method_for` refuses them on a checkpoint that is already quantized.

FP8 block-scaled (DeepSeek-V3, `transformers`' FineGrainedFP8): `<m>.weight` float8_e4m3fn (R, C) and
`<m>.weight_scale_inv` float32 (ceil(R/bR), ceil(C/bC)); weight = fp8.float() * scale_inv[r // bR, c // bC].
Dims need not divide by the block (the last block row/column is partial).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shared.model.config import UnsupportedModelError
from shared.model.int8 import Int8WeightOnly
from shared.model.mxfp4 import Mxfp4

FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# Tensor names that hold scales (of weights or activations): without a method that consumes them, the weights
# next to them are not the real weights.
SCALE_TENSOR = re.compile(r"(_scale_inv|_scale|\.scales|_scales)$")


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint's quantization is not one we can load correctly."""


class QuantizedCheckpointError(ValueError):
    """The tensors do not match the checkpoint's quantization (a scale missing, a stray scale, wrong shapes)."""


class TensorSource(Protocol):
    """The checkpoint's tensors by file name, readable whole or as a slice (safetensors' `get_slice`)."""

    def __contains__(self, name: str) -> bool: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, index: tuple = ()) -> torch.Tensor: ...


class QuantMethod(Protocol):
    @property
    def name(self) -> str:
        """The quant_method it reads ("none" for an unquantized checkpoint)."""
        ...

    def weight_name(self, name: str) -> str:
        """The name the unquantized checkpoint gives the tensor stored as `name` (MXFP4's `<w>_blocks` → `<w>`)."""
        ...

    def companion_of(self, name: str) -> str | None:
        """The weight tensor that checkpoint tensor `name` is read with (its scale: consumed by that weight's
        `read`, never loaded itself), or None for a tensor of its own."""
        ...

    def read(self, tensors: TensorSource, name: str, index: tuple) -> torch.Tensor:
        """Tensor `name` (its `index` slice; () = all) as the weight it stands for; QuantizedCheckpointError
        when its companions are missing or do not fit."""
        ...


QUANT_METHODS: dict[str, Callable[[dict[str, Any]], QuantMethod]] = {}


def register(quant_method: str) -> Callable:
    """Decorator: `factory(quantization_config) -> QuantMethod` loads checkpoints of `quant_method`."""

    def add(factory: Callable[[dict[str, Any]], QuantMethod]) -> Callable[[dict[str, Any]], QuantMethod]:
        QUANT_METHODS[quant_method] = factory
        return factory

    return add


def quant_method_for(raw_config: dict[str, Any]) -> QuantMethod:
    """The method that reads this checkpoint's tensors: `PLAIN` without a `quantization_config`."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return PLAIN
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization_config.quant_method={method!r} is not supported "
            f"(supported: {', '.join(sorted(QUANT_METHODS))}; or load an unquantized checkpoint)"
        )
    return QUANT_METHODS[method](qc)


@dataclass(frozen=True)
class _Plain:
    """No quantization: tensors are read as stored; float8 weights and scale tensors are refused."""

    name: str = "none"

    def weight_name(self, name: str) -> str:
        return name

    def companion_of(self, name: str) -> str | None:
        return None

    def read(self, tensors: TensorSource, name: str, index: tuple) -> torch.Tensor:
        if SCALE_TENSOR.search(name):
            raise QuantizedCheckpointError(
                f"checkpoint tensor {name} is a quantization scale, but config.json has no quantization_config: "
                "its weights would load as garbage"
            )
        if tensors.dtype(name) in FLOAT8:
            raise QuantizedCheckpointError(
                f"checkpoint tensor {name} is {tensors.dtype(name)}, but config.json has no quantization_config"
            )
        return tensors.read(name, index)


PLAIN = _Plain()


def module_excluded(module: str, patterns: list[str]) -> bool:
    """`transformers`' rule for `modules_to_not_convert`: a pattern matches from the start up to a module
    boundary (as a regex), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


@dataclass(frozen=True)
class BlockFp8:
    """FP8 weights with one float32 `weight_scale_inv` per (bR, bC) block, dequantized at load."""

    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()
    name: str = "fp8"

    def weight_name(self, name: str) -> str:
        return name

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> BlockFp8:
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise UnsupportedQuantizationError(
                f"fp8 with activation_scheme={qc['activation_scheme']!r} is not supported (dynamic only: "
                "static activation scales would be dropped)"
            )
        block = qc.get("weight_block_size")
        if block is None or len(block) != 2:
            raise UnsupportedQuantizationError(
                f"fp8 without a 2-D weight_block_size ({block!r}) is not supported (block-scaled FP8 only)"
            )
        if qc.get("scale_fmt") not in (None, "float32"):  # e.g. ue8m0 scales
            raise UnsupportedQuantizationError(f"fp8 with scale_fmt={qc['scale_fmt']!r} is not supported")
        skip = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        return cls(block=(int(block[0]), int(block[1])), not_converted=tuple(skip))

    def companion_of(self, name: str) -> str | None:
        return name.removesuffix("_scale_inv") if name.endswith(".weight_scale_inv") else None

    def read(self, tensors: TensorSource, name: str, index: tuple) -> torch.Tensor:
        if tensors.dtype(name) not in FLOAT8:
            if SCALE_TENSOR.search(name):
                raise QuantizedCheckpointError(f"fp8 checkpoint: unexpected scale tensor {name}")
            return tensors.read(name, index)  # an unquantized tensor (norms, embeddings, not-converted modules)
        module = name.removesuffix(".weight")
        scale_name = f"{module}.weight_scale_inv"
        if module_excluded(module, list(self.not_converted)):
            raise QuantizedCheckpointError(f"{name} is float8 but its module is listed in modules_to_not_convert")
        if scale_name not in tensors:
            raise QuantizedCheckpointError(f"{name} is float8 but the checkpoint has no {scale_name}")
        shape = tensors.shape(name)
        if len(shape) != 2:
            raise QuantizedCheckpointError(f"{name}: block-scaled fp8 expects a 2-D weight, got shape {shape}")
        grid = tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=True))
        if tensors.shape(scale_name) != grid:
            raise QuantizedCheckpointError(
                f"{scale_name} has shape {tensors.shape(scale_name)}; weight {shape} in blocks {self.block} "
                f"needs {grid}"
            )
        # Read only this rank's slice, and the scale blocks that cover it.
        rows, cols = _full_slices(index, shape)
        row_blocks, col_blocks = _covering(rows, self.block[0]), _covering(cols, self.block[1])
        weight = tensors.read(name, (rows, cols)).float()
        scale = tensors.read(scale_name, (row_blocks, col_blocks)).float()
        # (blocks_r, blocks_c) → per element over the covered span, then cut to the slice's offset within it
        scale = scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
        r0 = rows.start - row_blocks.start * self.block[0]
        c0 = cols.start - col_blocks.start * self.block[1]
        return weight * scale[r0 : r0 + weight.shape[0], c0 : c0 + weight.shape[1]]


register("fp8")(BlockFp8.from_config)
register("mxfp4")(Mxfp4.from_config)  # gpt-oss's experts (shared/model/mxfp4.py)


def _full_slices(index: tuple, shape: tuple[int, ...]) -> tuple[slice, slice]:
    """`index` (() or up to two contiguous slices) as two explicit (start, stop) slices of `shape`."""
    parts = list(index) + [slice(None)] * (2 - len(index))
    out = []
    for part, n in zip(parts, shape, strict=True):
        start, stop, step = part.indices(n)
        if step != 1:
            raise ValueError(f"only contiguous slices are read, got {part}")
        out.append(slice(start, stop))
    return out[0], out[1]


def _covering(s: slice, block: int) -> slice:
    """The block indices whose span covers elements [s.start, s.stop)."""
    return slice(s.start // block, math.ceil(s.stop / block))


class LoadMethod(Protocol):
    """A quantization made at load from a float checkpoint: it rewrites the loaded model's weights in place."""

    @property
    def name(self) -> str: ...

    def apply(self, model: nn.Module) -> str:
        """Quantize `model`'s weights in place; → a line for the log."""
        ...


LOAD_METHODS: dict[str, LoadMethod] = {
    "int8": Int8WeightOnly(keep_int8=True),
    "int8_dequantized": Int8WeightOnly(keep_int8=False),
}


def load_method_for(name: str, checkpoint: QuantMethod, dtype: torch.dtype, device: torch.device) -> LoadMethod:
    """The load-time method `name` for a checkpoint read by `checkpoint` into `dtype` on `device`;
    UnsupportedQuantizationError for an unknown name, a checkpoint that is already quantized, or where the method
    cannot compute (int8: float32 on a CPU)."""
    if name not in LOAD_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization {name!r} is not a method made at load (choose one of {', '.join(sorted(LOAD_METHODS))})"
        )
    if checkpoint.name != PLAIN.name:
        raise UnsupportedQuantizationError(
            f"quantization {name} quantizes a float checkpoint at load, but this checkpoint is already quantized "
            f"({checkpoint.name}): load it as it is, without a quantization setting"
        )
    if name == "int8" and (dtype != torch.float32 or device.type != "cpu"):
        raise UnsupportedQuantizationError(
            f"quantization int8 computes in float32 on the CPU, not {dtype} on {device} "
            "(int8_dequantized, its float twin, runs anywhere)"
        )
    return LOAD_METHODS[name]
