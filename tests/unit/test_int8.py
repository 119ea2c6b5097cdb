"""Weight-only int8 made at load (shared/model/int8.py): the quantizer, the CPU kernels' int8 paths against the
dequantized twin, whole engines in int8 against the twin and against float32, and the settings it refuses.

Tolerances (measured on the tiny demo checkpoints):
- int8 experts: bitwise the twin's (float32 kernel over the dequantized weights: same values, same FMA order);
- int8 dense linears: the twin's oneDNN GEMM up to float32 summation order, |diff| ≤ 1e-5 (rtol 1e-5);
- prefill logits, int8 engine against the twin: max |diff| ≤ 1e-4 x the largest logit's magnitude (measured: 0 on
  the three tiny checkpoints, where oneDNN's small-K GEMM sums in the kernel's order; against float32: 0.8-5%);
- greedy tokens: int8 identical to the twin; against float32 (a different model: rounded weights) the agreement
  is measured and reported, with a floor of half the tokens (measured, 24 tokens after each of 3 prompts:
  qwen3_moe 51/72, mixtral 50/72, qwen3 72/72: a random tiny model's logits are close together, so one flip
  early in a sequence changes the rest of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, Quantization
from shared.engine.engine import Engine
from shared.engine.kernel_setup import prepare_model
from shared.engine.sampling import SamplingParams
from shared.model import int8
from shared.model.experts import Experts
from shared.model.kernels import cpu_moe
from shared.model.loader import load_model
from shared.model.paged_attention import AttentionMetadata
from shared.model.panel_linear import PanelLinear
from shared.model.quantization import LOAD_METHODS, UnsupportedQuantizationError

BUILDS = cpu_moe.kernels()
needs_kernel = pytest.mark.skipif(not BUILDS, reason="the CPU expert kernel cannot be built or run on this host")
each_build = pytest.mark.parametrize(
    "build", BUILDS or [pytest.param(None, marks=needs_kernel)], ids=lambda b: b.isa if b else "none"
)
ARCHS = ["qwen3_moe", "mixtral", "qwen3"]  # two MoE architectures and a dense one (its MLPs are int8 linears)
PROMPT_LENGTHS = (5, 23, 70)
NEW_TOKENS = 24
MIN_AGREEMENT = 0.5  # greedy tokens equal to float32's, of all: a floor only (see the module docstring)


def test_quantize_is_symmetric_per_output_channel_and_rounds_to_nearest():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 6, 40, generator=gen)
    w[1, 2] = 0.0  # a row of zeros
    q, scale = int8.quantize(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 6) and scale.dtype == torch.float32
    assert q.abs().max().item() == 127 and q.min().item() >= -127
    assert torch.equal(q[1, 2], torch.zeros(40, dtype=torch.int8))
    torch.testing.assert_close(scale, w.abs().amax(-1) / 127, rtol=0, atol=torch.finfo(torch.float32).tiny)
    error = (int8.dequantize(q, scale) - w).abs()
    assert (error <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all()  # round to nearest: within half a step


def _experts(num_experts: int, hidden: int, intermediate: int, seed: int) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, hidden, intermediate)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=gen) * 0.2)
        experts.down.copy_(torch.randn(experts.down.shape, generator=gen) * 0.2)
    return experts


@each_build
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_int8_expert_kernel_gives_the_bits_of_float32_over_the_dequantized_weights(build, top_k):
    """Every row count 1..40: the int8 panels (q, per-column scales) against the float32 kernel over the
    dequantized twin, bitwise; and near the torch reference."""
    experts = _experts(8, 64, 48, seed=top_k)
    method = int8.Int8WeightOnly()
    method.apply(experts)  # the parameters now hold the twin's values, `int8` the int8 ones
    assert experts.int8 is not None
    int8_panels = build.pack_int8(*experts.int8)
    twin_panels = build.pack(experts.gate_up.data, experts.down.data)
    assert int8_panels.gate_up.dtype == torch.int8 and int8_panels.gate_up.nbytes * 4 == twin_panels.gate_up.nbytes
    gen = torch.Generator().manual_seed(30 + top_k)
    for tokens in range(1, 41):
        x = torch.randn(tokens, 64, generator=gen)
        ids = torch.rand(tokens, 8, generator=gen).argsort(dim=1)[:, :top_k]
        weights = torch.rand(tokens, top_k, generator=gen).softmax(dim=1)
        with torch.inference_mode():
            quantized = build.moe(x, ids, weights, int8_panels)
            twin = build.moe(x, ids, weights, twin_panels)
            reference = experts.forward_grouped_mm(x, ids, weights, torch.bincount(ids.flatten(), minlength=8))
        assert torch.equal(quantized, twin), tokens
        torch.testing.assert_close(quantized, reference, rtol=1e-5, atol=1e-5)


@each_build
def test_int8_linear_matches_the_dequantized_weight(build):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 80, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen)
    q, scale = int8.quantize(weight)
    assert int8.Int8Linear.fits(build, q) and not int8.Int8Linear.fits(build, q[:40])
    served = int8.Int8Linear.pack(build, q, scale)
    for rows in (1, 7, 13, 33):
        x = torch.randn(2, rows, 80, generator=gen)
        torch.testing.assert_close(
            served.matmul(x, bias), F.linear(x, int8.dequantize(q, scale), bias), rtol=1e-5, atol=1e-5
        )


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp(request.param), request.param, "tiny")


def _prepared(checkpoint: Path, quantization: str | None):
    config = EngineConfig(model=str(checkpoint), quantization=quantization)
    model = load_model(checkpoint, quantization=quantization)
    prepare_model(model, config, torch.device("cpu"))
    return model


def _prefill_logits(model, n: int = 40) -> torch.Tensor:
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    caches = [torch.zeros((cfg.kv_planes, 4, 16, cfg.num_kv_heads, cfg.kv_width)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build([[0, 1, 2]], [n], [n], 16, windows=cfg.windows)
    with torch.no_grad():
        return model.logits(model(prompt, torch.arange(n), caches, meta)).float()


@needs_kernel
def test_int8_model_reads_int8_and_its_prefill_logits_are_the_twins(checkpoint):
    quantized, twin = _prepared(checkpoint, "int8"), _prepared(checkpoint, "int8_dequantized")
    experts = [m for m in quantized.modules() if isinstance(m, Experts)]
    assert all(m._panels is not None and m._panels.gate_up.dtype == torch.int8 for m in experts)
    served = [f for m in quantized.modules() for f in (m.__dict__.get("_formats") or {}).values()]
    # attention's projections at least; a linear whose output count the int8 panels do not divide stays float32
    # (dequantized), on the float32 panels (shared/model/panel_linear.py)
    assert any(isinstance(f, int8.Int8Linear) for f in served)
    assert all(isinstance(f, int8.Int8Linear | PanelLinear) for f in served)
    # the twin is a float32 model: its linears are float32 (on the panel kernel, shared/model/panel_linear.py)
    twin_formats = [f for m in twin.modules() for f in (m.__dict__.get("_formats") or {}).values()]
    assert not any(isinstance(f, int8.Int8Linear) for f in twin_formats)
    ours, reference = _prefill_logits(quantized), _prefill_logits(twin)
    assert (ours - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()


def _greedy(checkpoint: Path, quantization: str | None) -> list[list[int]]:
    engine = Engine.from_dir(checkpoint, quantization=quantization, num_kv_blocks=64, max_model_len=512)
    gen = torch.Generator().manual_seed(1234)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))


def test_int8_engine_generates_the_twins_tokens_and_mostly_float32s(checkpoint, record_property, capsys):
    quantized = _greedy(checkpoint, "int8")
    assert quantized == _greedy(checkpoint, "int8_dequantized")
    full = _greedy(checkpoint, None)
    agree = sum(a == b for ours, ref in zip(quantized, full, strict=True) for a, b in zip(ours, ref, strict=True))
    total = sum(len(ref) for ref in full)
    record_property("int8_greedy_agreement_with_float32", f"{agree}/{total}")
    with capsys.disabled():
        print(f"\n{checkpoint.name}: int8 greedy tokens equal to float32's: {agree}/{total}")
    assert agree >= MIN_AGREEMENT * total


def test_the_load_methods_are_the_settings_choices():
    assert set(LOAD_METHODS) == {str(q) for q in Quantization}


def test_bad_int8_settings_are_refused_by_name(tmp_path):
    demo = write_demo_checkpoint(tmp_path / "demo", "qwen3_moe", "tiny")
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        EngineConfig(model=str(demo), quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedQuantizationError, match="'int4' is not a method made at load"):
        load_model(demo, quantization="int4")
    with pytest.raises(ValueError, match="int8 computes in float32"):
        EngineConfig(model=str(demo), quantization=Quantization.INT8, dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedQuantizationError, match="float32 on the CPU, not torch.bfloat16"):
        load_model(demo, dtype="bfloat16", quantization="int8")
    config = json.loads((demo / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (demo / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match=r"already quantized \(fp8\)"):
        load_model(demo, quantization="int8")
