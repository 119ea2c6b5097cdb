"""The engine's `kernels` setting: the Triton kernels (decode attention, fused MoE) selected in place of the
torch path give the same greedy tokens. On CPU the kernels run under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before triton can be imported), so shapes stay tiny."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.config_fields import add_flags, from_args, from_env
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.kernels.choice import KernelChoice, resolve_kernels
from shared.model.paged_attention import AttentionMetadata
from shared.settings import WorkerSettings

pytest.importorskip("triton", reason="the kernels need triton")
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1 (tests/conftest.py)"
)

# Lengths chosen so decodes have ragged contexts across a block boundary (block size 4) and a later prefill
# chunk (budget 16) runs beside decodes.
PROMPTS = {"a": [5, 6, 7], "b": list(range(1, 12)), "c": list(range(20, 43))}
MAX_TOKENS = 6


# gpt_oss: the decode kernel with sinks and its 16-token window (prompt "c" and the decodes pass it); its
# experts have biases and a clamp fused_moe lacks, so they stay on torch (no fused_moe call: no "moe" in the path)
@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3", "gpt_oss"])
def checkpoint(request, tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny")


def generate(checkpoint, kernels: KernelChoice) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Greedy tokens per request, and every step's logits (sorted by request id) stacked."""
    engine = Engine.from_dir(
        checkpoint,
        kernels=kernels,
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    logits = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        logits.append(torch.stack([engine.last_logits[r] for r in sorted(engine.last_logits)]))
    return out, logits


@interpreted
def test_triton_kernels_generate_the_torch_tokens(checkpoint, monkeypatch):
    calls = {"attention": 0, "moe": 0}
    from shared.model.kernels import fused_moe, paged_decode_attention

    for name, module, fn in (
        ("attention", paged_decode_attention, "paged_decode_attention"),
        ("moe", fused_moe, "fused_moe"),
    ):
        real = getattr(module, fn)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, fn, counted)
    reference, reference_logits = generate(checkpoint, KernelChoice.TORCH)
    assert calls == {"attention": 0, "moe": 0}
    kernels, kernel_logits = generate(checkpoint, KernelChoice.TRITON)
    assert kernels == reference
    # tokens alone can hide a wrong kernel on a tiny random model; the logits cannot
    assert len(kernel_logits) == len(reference_logits)
    for got, want in zip(kernel_logits, reference_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(len(t) == MAX_TOKENS for t in kernels.values())
    assert calls["attention"] > 0  # the kernels really ran
    assert (calls["moe"] > 0) == ("moe" in str(checkpoint))


def test_auto_resolves_to_torch_off_cuda(model_dir):
    for device in ("cpu", "meta"):
        assert resolve_kernels(KernelChoice.AUTO, torch.device(device), 16) is KernelChoice.TORCH
    engine = Engine.from_dir(model_dir, num_kv_blocks=8, max_model_len=128)
    assert engine.config.kernels is KernelChoice.AUTO
    assert engine.kernels is KernelChoice.TORCH and engine.model.kernels is KernelChoice.TORCH


def test_triton_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernels(KernelChoice.TRITON, torch.device("cpu"), 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels(KernelChoice.TRITON, torch.device("cpu"), 16) is KernelChoice.TRITON
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernels(KernelChoice.TRITON, torch.device("meta"), 16)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        resolve_kernels(KernelChoice.TRITON, torch.device("cpu"), 12)


def test_metadata_lays_decodes_out_for_the_chosen_kernels():
    args = ([[3, 4], [7], [1, 2, 5]], [6, 2, 9], [1, 1, 4], 4)
    torch_meta = AttentionMetadata.build(*args)
    assert torch_meta.kernel_decodes is None and torch_meta.decodes
    meta = AttentionMetadata.build(*args, kernels=KernelChoice.TRITON)
    assert meta.decodes == [] and meta.kernel_decodes is not None and len(meta.prefills) == 1
    assert meta.kernel_decodes.blocks.tolist() == [[3, 4], [7, 0]]
    assert meta.kernel_decodes.context_lens.tolist() == [6, 2] and meta.kernel_decodes.max_context_len == 6


def test_the_setting_parses_from_env_and_flag():
    assert from_env(WorkerSettings, {"PDSERVE_KERNELS": "triton"}).engine.kernels is KernelChoice.TRITON
    assert from_env(WorkerSettings, {}).engine.kernels is KernelChoice.AUTO
    p = argparse.ArgumentParser()
    add_flags(p, WorkerSettings)
    s = from_args(WorkerSettings, p.parse_args(["--kernels", "torch"]), {"PDSERVE_KERNELS": "triton"})
    assert s.engine.kernels is KernelChoice.TORCH
    with pytest.raises(ValueError, match="PDSERVE_KERNELS"):
        from_env(WorkerSettings, {"PDSERVE_KERNELS": "cuda"})
    with pytest.raises(ValueError, match="unknown kernels"):
        EngineConfig(model="m", kernels="fast")  # type: ignore[arg-type]
