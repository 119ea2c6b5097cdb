"""Weight-only int8, made at load from a float checkpoint: symmetric, one float32 scale per output channel.

A weight W (..., N, K) (N outputs, K inputs) becomes q = round(W / s) in [-127, 127] with s = max_k |W[n, k]| / 127
per row n; W ≈ q * s. What is quantized: the routed experts' gate/up and down, the dense linears each module
lists (`PackedWeights.int8_weights()`: attention's projections, dense and shared-expert MLPs, the LM head; not
the router, whose scores decide routing, nor a shared-expert gate of one row; a tied LM head is the embedding
table, so the embedding lookup then reads its dequantized rows too). Under tensor parallelism each rank's rows
are quantized as it holds them (a row-parallel shard gets scales of its own part of each row).

Two methods (shared/model/quantization.py LOAD_METHODS): `int8` and its twin `int8_dequantized`. Both overwrite
each quantized parameter with its dequantized values q * s, rounded to float32 once: every path that reads the
float parameters (the torch paths, CUDA, the tests' references) computes the twin's numbers. `int8` also keeps q
and s; at engine start (`use_int8_kernels`) the CPU kernel library (shared/model/kernels/cpu_moe.c) takes them,
and the routed experts and dense linears read int8 bytes, a quarter of float32's, dequantizing each weight vector
in registers (q * s, the same float32 value as the twin's) before float32 FMAs. Activations stay float32: VNNI's
int8 dot products would need quantized activations too (another error, and a per-step quantization of them), and
a decode step is bound by the weight bytes it reads, which weight-only int8 already quarters. So the int8 experts
give the twin's bits exactly (same values, same FMA order as the float32 kernel); the dense linears differ from
the twin's oneDNN GEMMs in summation order only (float32 rounding, tests/unit/test_int8.py).

The float parameters stay next to the int8 copies (like oneDNN prepacking's second copy): memory is not what this
saves, bytes read per step are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.model.experts import Experts
from shared.model.kernels import cpu_moe
from shared.model.linear import PackedWeights

QMAX = 127  # symmetric: -128 is never used, so -q is always representable


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (..., N, K) → (q (..., N, K) int8, scale (..., N) float32), per output channel (row); a row of zeros
    gets the smallest normal scale and q = 0."""
    w = weight.detach().float()
    scale = (w.abs().amax(-1) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (..., N, K) int8, scale (..., N) → float32 q * scale, each element rounded once (the kernels' value)."""
    return q.float() * scale.unsqueeze(-1)


@dataclass(frozen=True)
class Int8Linear:
    """A dense linear's int8 weight in the CPU kernel's panel layout: `linear()` (shared/model/linear.py) calls
    `matmul` for a weight that is not a tensor."""

    kernel: cpu_moe.Kernel
    panels: torch.Tensor  # (N/2L, K, 2L) int8
    scale: torch.Tensor  # (N/2L, 2L) float32
    out_features: int

    @classmethod
    def pack(cls, kernel: cpu_moe.Kernel, q: torch.Tensor, scale: torch.Tensor) -> Int8Linear:
        """q (N, K) int8, scale (N,); N a multiple of 2L (`fits`)."""
        n, k = q.shape
        width = 2 * kernel.lanes
        panels = q.reshape(n // width, width, k).transpose(1, 2).contiguous()
        return cls(kernel, panels, scale.reshape(n // width, width).float().contiguous(), n)

    @staticmethod
    def fits(kernel: cpu_moe.Kernel, q: torch.Tensor) -> bool:
        return q.dim() == 2 and q.shape[0] % (2 * kernel.lanes) == 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) float32 → (..., N)."""
        out = self.kernel.linear_i8(x.reshape(-1, x.shape[-1]), self.panels, self.scale)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias


@dataclass(frozen=True)
class Int8WeightOnly:
    """The load-time method: quantize `model`'s weights in place (see the module docstring); `keep_int8` = the
    `int8` method (keeps q and scales for the kernels), False = its `int8_dequantized` twin."""

    keep_int8: bool = True

    @property
    def name(self) -> str:
        return "int8" if self.keep_int8 else "int8_dequantized"

    def apply(self, model: nn.Module) -> str:
        """→ a line for the log saying what was quantized."""
        tensors, params = 0, 0
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Experts):
                    pair = quantize(module.gate_up), quantize(module.down)
                    module.gate_up.copy_(dequantize(*pair[0]))
                    module.down.copy_(dequantize(*pair[1]))
                    if self.keep_int8:
                        module.int8 = pair
                    tensors, params = tensors + 2, params + module.gate_up.numel() + module.down.numel()
                if isinstance(module, PackedWeights):
                    kept = {}
                    for name in module.int8_weights():
                        weight = module.plain_weight(name)
                        q, scale = quantize(weight)
                        weight.copy_(dequantize(q, scale))
                        kept[name] = (q, scale)
                        tensors, params = tensors + 1, params + weight.numel()
                    if self.keep_int8 and kept:
                        module.__dict__["_int8_source"] = kept
        return f"{self.name}: {tensors} weight tensors ({params / 1e6:.1f} M values), per-output-channel scales"


def use_int8_kernels(model: nn.Module, kernel: cpu_moe.Kernel) -> str:
    """Hand the int8 dense weights `Int8WeightOnly(keep_int8=True)` kept to the CPU kernel build `kernel`: the
    linears whose output count divides its panels read int8 from then on; the rest keep their (dequantized)
    float weights. The experts take theirs in `Experts.use_cpu_kernel`. → a line for the log."""
    used, total = 0, 0
    for module in model.modules():
        source = module.__dict__.get("_int8_source") if isinstance(module, PackedWeights) else None
        if not source:
            continue
        served = {}
        for name, (q, scale) in source.items():
            total += 1
            if Int8Linear.fits(kernel, q):
                served[name] = Int8Linear.pack(kernel, q, scale)
        module.__dict__["_formats"] = served
        used += len(served)
    return f"int8 dense linears: {used}/{total} on the {kernel.isa} kernel" + (
        " (the rest: float32, dequantized, output count not a multiple of the panel width)" if used < total else ""
    )
