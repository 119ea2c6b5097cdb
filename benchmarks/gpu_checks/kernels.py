"""Check 2: each Triton kernel (shared/model/kernels/) against its torch reference, and its speed against the
torch path the model runs today (paged_attention's decode branch; Experts.forward, the grouped MoE loop).

On a GPU the shapes are realistic (ATTENTION_GPU, MOE_GPU: a Qwen3-30B-A3B-like layer, 32 decode sequences
with ragged contexts up to 4096 tokens); under --allow-cpu the kernels are interpreted (TRITON_INTERPRET=1,
set by benchmarks/gpu_check.py) on tiny shapes, and their "speed" measures the interpreter, nothing else.
Tolerances are those of tests/unit/test_kernel_*.py (float32 a little wider for the longer sums).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_checks.common import CheckResult, Target, max_diff, median_ms, verdict
from shared.model.experts import Experts
from shared.model.kernels.fused_moe import fused_moe, fused_moe_reference
from shared.model.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from shared.model.paged_attention import AttentionMetadata, paged_attention

NAME = "kernels"
# Bd sequences, H query heads, KVH KV heads, hd head dim, B tokens per block, longest context
ATTENTION_GPU: dict[str, Any] = dict(batch=32, heads=32, kv_heads=8, head_dim=128, block_size=16, max_len=4096)
ATTENTION_CPU: dict[str, Any] = dict(batch=4, heads=4, kv_heads=2, head_dim=16, block_size=8, max_len=40)
# T tokens, D hidden, E experts, A experts per token, I expert intermediate size
MOE_GPU: dict[str, Any] = dict(tokens=(32, 512), hidden=2048, experts=64, top_k=8, inter=768)
MOE_CPU: dict[str, Any] = dict(tokens=(5, 33), hidden=32, experts=8, top_k=2, inter=16)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
SCALE = 0.088  # ~ 1 / sqrt(128)


def check(target: Target) -> CheckResult:
    device = target.device()
    repeats = 3 if target.cpu else 50
    # bf16 MoE is skipped under the interpreter: triton 3.7.1 multiplies bf16 tiles as raw bits there.
    moe_dtypes = (torch.float32,) if target.cpu else (torch.float32, torch.bfloat16)
    numbers: dict[str, dict] = {}
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        row, why = _attention(ATTENTION_CPU if target.cpu else ATTENTION_GPU, dtype, device, repeats)
        numbers[f"paged_decode_attention {_name(dtype)}"] = row
        failures += why
    for dtype in moe_dtypes:
        shape = MOE_CPU if target.cpu else MOE_GPU
        for tokens in shape["tokens"]:
            row, why = _moe(shape | dict(tokens=tokens), dtype, device, repeats)
            numbers[f"fused_moe {_name(dtype)} T={tokens}"] = row
            failures += why
    shapes = (ATTENTION_CPU, MOE_CPU) if target.cpu else (ATTENTION_GPU, MOE_GPU)
    tolerances = ", ".join(f"{_name(d)} {t}" for d, t in TOLERANCE.items())
    details = (f"max |kernel - reference| within {tolerances}; ms per call: median of {repeats} on {device}; "
               f"attention {shapes[0]}, MoE {shapes[1]}")  # fmt: skip
    if target.cpu:
        details += "; interpreted on CPU (TRITON_INTERPRET=1): timings are the interpreter's, bf16 MoE skipped"
    return verdict(NAME, failures, numbers, details)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _attention(shape: dict, dtype: torch.dtype, device: str, repeats: int) -> tuple[dict, list[str]]:
    """Kernel, reference and paged_attention's decode branch over one scattered pool of ragged contexts."""
    gen = torch.Generator().manual_seed(0)
    bd, heads, kvh, hd, bs = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "block_size"))
    lens = torch.randint(1, shape["max_len"] + 1, (bd,), generator=gen)
    lens[0] = shape["max_len"]
    width = -(-shape["max_len"] // bs)
    num_blocks = bd * width
    tables = torch.randperm(num_blocks, generator=gen).view(bd, width)
    kv_cache = torch.randn(2, num_blocks, bs, kvh, hd, generator=gen).to(device, dtype)
    q = torch.randn(bd, heads, hd, generator=gen).to(device, dtype)
    lens_list = lens.tolist()
    used = [row[: -(-n // bs)] for row, n in zip(tables.tolist(), lens_list, strict=True)]
    meta = AttentionMetadata.build(used, lens_list, [1] * bd, bs, device=device)
    # this step's k, v = what the cache already holds at each last position: the model path's write is a no-op
    last = torch.tensor([row[(n - 1) // bs] * bs + (n - 1) % bs for row, n in zip(used, lens_list, strict=True)])
    k, v = kv_cache.view(2, -1, kvh, hd)[:, last.to(device)]
    tables, lens = tables.to(device), lens.to(device)
    max_len = shape["max_len"]
    kernel = paged_decode_attention(q, kv_cache, tables, lens, SCALE, max_context_len=max_len)
    reference = paged_decode_attention_reference(q, kv_cache, tables, lens, SCALE)
    model = paged_attention(q, k, v, kv_cache, meta, SCALE)
    row = dict(max_diff_reference=max_diff(kernel, reference), max_diff_model_path=max_diff(kernel, model))
    row["kernel_ms"] = median_ms(lambda: paged_decode_attention(q, kv_cache, tables, lens, SCALE,
                                                                max_context_len=max_len), device, repeats)  # fmt: skip
    row["torch_path_ms"] = median_ms(lambda: paged_attention(q, k, v, kv_cache, meta, SCALE), device, repeats)
    row["speedup"] = row["torch_path_ms"] / row["kernel_ms"]
    row["context_tokens"] = int(lens.sum())
    tol = TOLERANCE[dtype]
    failures = [f"paged_decode_attention {_name(dtype)}: {what} differs by {row[key]:.2e} (> {tol})"
                for what, key in (("reference", "max_diff_reference"), ("model path", "max_diff_model_path"))
                if not row[key] <= tol]  # fmt: skip
    return row, failures


def _moe(shape: dict, dtype: torch.dtype, device: str, repeats: int) -> tuple[dict, list[str]]:
    """fused_moe against fused_moe_reference, and timed against Experts.forward (the model's grouped loop)."""
    gen = torch.Generator().manual_seed(1)
    t, d, e, a, i = (shape[k] for k in ("tokens", "hidden", "experts", "top_k", "inter"))
    experts = Experts(e, d, i)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(e, 2 * i, d, generator=gen) / d**0.5)
        experts.down.copy_(torch.randn(e, d, i, generator=gen) / i**0.5)
    experts = experts.to(device, dtype).requires_grad_(False)
    ids = torch.rand(t, e, generator=gen).topk(a, dim=-1).indices.to(device)
    weights = torch.rand(t, a, generator=gen) + 0.1
    weights = (weights / weights.sum(-1, keepdim=True)).to(device)
    x = torch.randn(t, d, generator=gen).to(device, dtype)
    counts = torch.bincount(ids.flatten(), minlength=e)
    args = (x, experts.gate_up, experts.down, ids, weights)
    row = dict(max_diff_reference=max_diff(fused_moe(*args), fused_moe_reference(*args)))
    row["kernel_ms"] = median_ms(lambda: fused_moe(*args), device, repeats)
    row["torch_path_ms"] = median_ms(lambda: experts(x, ids, weights, counts), device, repeats)
    row["speedup"] = row["torch_path_ms"] / row["kernel_ms"]
    tol = TOLERANCE[dtype]
    failures = []
    if not row["max_diff_reference"] <= tol:
        failures.append(f"fused_moe {_name(dtype)} T={t}: differs by {row['max_diff_reference']:.2e} (> {tol})")
    return row, failures
