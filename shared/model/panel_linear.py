"""Dense float32 projections through the CPU kernel library's panel linear, instead of oneDNN's packed GEMM.

At decode a projection is a stream of its weight's bytes, and the oneDNN GEMM it otherwise takes
(shared/model/linear.py's packed weights) pays ~10 µs a call before it reads a byte (measured on the 2-core
AMD EPYC: a packed (8, 512) weight takes 11 µs at one row where the plain GEMM takes 1.6) and then streams below
the read bandwidth. `pdserve_linear_f32` (shared/model/kernels/cpu_moe.c, the int8 linears' micro-kernel over
float32 weights) reads the weight in panels laid out for it, once per tile of up to 12 rows (6 on AVX2).
Measured there with the demo's (768, 512) and (512, 512) projections, one thread, weights out of cache: 50/32 µs
at 1 row against oneDNN's 63/38, 52/35 against 74/57 at 8, 106/73 against 145/107 at 32; at 64-512 rows (prefill,
a (3072, 1024) weight too) within 2% of oneDNN at one thread, and from 20% faster to 5% slower at two
(docs/benchmarks.md, "Decode at one sequence"). So the panels serve every batch size and replace the packed twin:
the same memory as prepacking (the parameter and one copy).

It covers the linears a module lists as `panel_weights()` (attention's projections, dense and shared-expert MLPs,
an untied LM head, and the router when it has no logit bias: the panel gives each row the same bits whatever the
batch, which a router's scores must have and oneDNN's packed GEMM lacks at real routers' shapes), float32 on the
CPU. An output count that is not a multiple of the kernel's panel width (2L; the demo's 259-token vocabulary, a
router's 8-256 experts) gets zero rows to the next multiple, and the product's padding columns are cut off (one
small copy). The results differ from oneDNN's in the last bits (summation order), as the expert kernel's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.model.kernels import cpu_moe
from shared.model.linear import PackedWeights


@dataclass(frozen=True)
class PanelLinear:
    """A float32 weight (N, K) in the kernel's panel layout (ceil(N/2L), K, 2L), zero rows past N: `linear()`
    calls `matmul` for a weight that is not a tensor."""

    kernel: cpu_moe.Kernel
    panels: torch.Tensor  # (ceil(N/2L), K, 2L) float32
    out_features: int

    @classmethod
    def pack(cls, kernel: cpu_moe.Kernel, weight: torch.Tensor) -> PanelLinear:
        n, k = weight.shape
        width = 2 * kernel.lanes
        padded = -(-n // width) * width
        rows = torch.zeros(padded, k, dtype=weight.dtype)
        rows[:n] = weight.detach()
        return cls(kernel, rows.reshape(padded // width, width, k).transpose(1, 2).contiguous(), n)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) float32 → (..., N); the bias added after the product (one more rounding than nn.Linear's
        fused bias, as Int8Linear's)."""
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the model's (T, K): no reshape op
        out = self.kernel.linear_f32(flat, self.panels)
        if out.shape[1] != self.out_features:  # padded panels: the real columns, contiguous
            out = out[:, : self.out_features].contiguous()
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias


def use_panel_linears(model: nn.Module, kernel: cpu_moe.Kernel) -> str:
    """Give each dense float32 linear of `model` a PanelLinear, before prepacking (which then packs none of
    them); linears another format serves (int8) keep it. → a line for the engine's log."""
    used, total = 0, 0
    for module in model.modules():
        if not isinstance(module, PackedWeights):
            continue
        formats = module.__dict__.setdefault("_formats", {})
        for name in module.panel_weights():
            total += 1
            weight = module.plain_weight(name)
            if name not in formats and PanelLinear.fits(weight):
                formats[name] = PanelLinear.pack(kernel, weight)
                used += 1
    return f"{used}/{total} dense linears on the {kernel.isa} panel kernel"
