"""Dense float32 projections of decode-sized batches through the CPU kernel library's panel linear.

At a batch of one to a few dozen rows a projection is a stream of its weight's bytes, and the oneDNN GEMM it
otherwise takes (shared/model/linear.py's packed weights) pays ~10 µs a call before it reads a byte (measured on
the 2-core AMD EPYC: a packed (8, 512) router weight takes 11 µs at one row where the plain GEMM takes 1.6) and
then streams below the read bandwidth. `pdserve_linear_f32` (shared/model/kernels/cpu_moe.c) reads the weight
once, in panels laid out for it, and computes the whole batch from that stream. Larger batches (prefill) keep
the packed weight, where oneDNN's blocking wins (docs/benchmarks.md, "Where a decode step goes").

The format is a second copy of the weight, like prepacking's. It covers the linears a module lists as
`int8_weights()` (attention's projections, dense and shared-expert MLPs, an untied LM head: never the router,
whose scores decide routing), float32, whose output count is a multiple of the kernel's panel width (2L). The
results differ from oneDNN's in the last bits (summation order), as the expert kernel's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.model.kernels import cpu_moe
from shared.model.linear import PackedWeights, linear

# Batches of up to this many rows take the panel kernel. Measured on the 2-core AMD EPYC, one thread, the
# demo's (768, 512) and (512, 512) projections with their weights out of cache: the kernel 50/32 µs at 1 row
# against oneDNN's packed 63/38, 52/35 against 74/57 at 8 rows, 106/73 against 145/107 at 32; at 128 rows
# they tie and at 512 oneDNN's blocking wins.
PANEL_MAX_ROWS = 32


@dataclass(frozen=True)
class PanelLinear:
    """A float32 weight (N, K) in the kernel's panel layout (N/2L, K, 2L), and what serves larger batches:
    `linear()` calls `matmul` for a weight that is not a tensor."""

    kernel: cpu_moe.Kernel
    panels: torch.Tensor  # (N/2L, K, 2L) float32
    large: torch.Tensor  # (N, K): the oneDNN-packed twin or the parameter, for batches above PANEL_MAX_ROWS
    out_features: int

    @classmethod
    def pack(cls, kernel: cpu_moe.Kernel, weight: torch.Tensor, large: torch.Tensor) -> PanelLinear:
        n, k = weight.shape
        width = 2 * kernel.lanes
        panels = weight.detach().reshape(n // width, width, k).transpose(1, 2).contiguous()
        return cls(kernel, panels, large, n)

    @staticmethod
    def fits(kernel: cpu_moe.Kernel, weight: torch.Tensor) -> bool:
        return (
            weight.dim() == 2
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.shape[0] % (2 * kernel.lanes) == 0
        )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) float32 → (..., N); the bias added after the product (one more rounding than nn.Linear's
        fused bias, as Int8Linear's)."""
        rows = x.numel() // x.shape[-1]
        if rows > PANEL_MAX_ROWS or x.dtype != torch.float32:
            return linear(x, self.large, bias)
        if x.dim() == 2:  # the model's (T, K): no reshape and view around the call (two ops a linear)
            out = self.kernel.linear_f32(x, self.panels)
        else:
            out = self.kernel.linear_f32(x.reshape(rows, x.shape[-1]), self.panels)
            out = out.view(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias


def use_panel_linears(model: nn.Module, kernel: cpu_moe.Kernel) -> str:
    """Give each dense float32 linear of `model` that fits the panels a PanelLinear over the weight it serves
    now (packed or plain), after prepacking; linears another format serves (int8) keep it. → a line for the
    engine's log."""
    used, total = 0, 0
    for module in model.modules():
        if not isinstance(module, PackedWeights):
            continue
        formats = module.__dict__.setdefault("_formats", {})
        for name in module.int8_weights():
            total += 1
            weight = module.plain_weight(name)
            if name in formats or not PanelLinear.fits(kernel, weight):
                continue
            large = module.w(name)
            assert isinstance(large, torch.Tensor)  # no other format serves it (checked above)
            formats[name] = PanelLinear.pack(kernel, weight, large)
            used += 1
    return f"{used}/{total} dense linears on the {kernel.isa} panel kernel up to {PANEL_MAX_ROWS} rows"
