"""Readying a loaded model for its device: prepacked weights, the kernel choice, the CPU kernels.

Runs once per engine, before the KV plan (whose dummy step on CUDA runs the chosen kernels and measures what
the weights and their packed twins left of the device).
"""

from __future__ import annotations

import logging

import torch

from shared.engine.config import EngineConfig, Quantization
from shared.model.attention import use_cpu_attention_kernel, use_cpu_norm_rope_kernel
from shared.model.int8 import use_int8_kernels
from shared.model.kernels import cpu_moe
from shared.model.kernels.choice import KernelChoice, resolve_kernels
from shared.model.linear import can_prepack, prepack
from shared.model.moe import use_cpu_expert_kernel
from shared.model.panel_linear import use_panel_linears
from shared.model.transformer import CausalLM

log = logging.getLogger(__name__)


def prepare_model(model: CausalLM, config: EngineConfig, device: torch.device) -> KernelChoice:
    """Check the model against the configuration (its device, its parallel layout), prepack its weights where
    that pays, choose its kernels and hand them to it (`CausalLM.use_kernels`), switch on the CPU kernels the
    settings ask for. Changes the model in place; → the kernels it runs. ValueError on a mismatch."""
    weight = next(model.parameters())
    if weight.device != device:
        raise ValueError(f"the model is on {weight.device}, the engine is configured for {device}")
    kernels = resolve_kernels(config.kernels, device, config.block_size)
    torch_on_cpu = device.type == "cpu" and kernels is KernelChoice.TORCH
    if config.cpu_expert_kernel and torch_on_cpu and config.quantization == Quantization.INT8:
        # before prepacking: the linears the int8 kernel serves get no oneDNN pack
        build = cpu_moe.load()
        log.info("int8: %s", use_int8_kernels(model, build) if build else "the CPU kernel is unavailable: float32")
    if config.cpu_linear_kernel and torch_on_cpu and weight.dtype == torch.float32:
        # before prepacking too: the linears on panels get no oneDNN pack
        build = cpu_moe.load()
        log.info("CPU linears: %s", use_panel_linears(model, build) if build else "the CPU kernel is unavailable")
    if config.prepack_weights and can_prepack(device, weight.dtype):
        prepack(model)
    model.use_kernels(kernels)
    log.info("kernels: %s (setting %s, device %s)", kernels, config.kernels, device)
    if config.cpu_expert_kernel and torch_on_cpu:
        log.info("CPU experts: %s", use_cpu_expert_kernel(model))
    if config.cpu_attention_kernel and torch_on_cpu:
        log.info("CPU decode attention: %s", use_cpu_attention_kernel(model))
    else:
        model.cpu_attention = False
    if config.cpu_norm_kernel and device.type == "cpu":
        log.info("CPU norms and RoPE: %s", use_cpu_norm_rope_kernel(model))
    if model.layout != config.parallel:
        raise ValueError(f"the model was built for {model.layout}, the engine is configured for {config.parallel}")
    return kernels
