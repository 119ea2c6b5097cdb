"""MXFP4 gpt-oss checkpoints: the format's round trip, and a tiny checkpoint quantized here that loads as the
same model as the one written from its dequantized weights (and as transformers reads it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.demo_model import write_demo_checkpoint
from shared.model.config import UnsupportedModelError
from shared.model.loader import load_model
from shared.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def test_dequantize_reads_nibbles_low_first_with_power_of_two_scales():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # low nibble 2 (1.0), high nibble 7 (6.0)
    blocks[0, 1] = 0x9F  # low nibble 15 (-6.0), high nibble 9 (-0.5)
    scales = torch.tensor([127 + 3], dtype=torch.uint8)  # x 8
    values = dequantize_mxfp4(blocks, scales)
    assert values.shape == (32,)
    assert values[:4].tolist() == [8.0, 48.0, -48.0, -4.0]
    assert not values[4:].any()


def test_quantize_round_trips_and_stays_within_fp4_rounding():
    w = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    back = dequantize_mxfp4(blocks, scales)
    # FP4 has a 1-bit mantissa: each value within half a step (<= 1/4 of its group's scaled max of 6 x 2^e)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).view_as(w)
    assert ((back - w).abs() <= step + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back)), back)  # representable values are kept exactly


def _mxfp4_pair(root, tmp_path_factory) -> tuple:
    """(the MXFP4 checkpoint, the plain one holding exactly its dequantized weights)."""
    plain = write_demo_checkpoint(tmp_path_factory.mktemp("plain"), arch="gpt_oss")
    quant = tmp_path_factory.mktemp("mxfp4")
    for f in plain.iterdir():
        shutil.copy(f, quant / f.name)
    tensors = load_file(str(plain / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    for name, t in tensors.items():
        if name.endswith(tuple(f"mlp.experts.{w}" for w in EXPERT_WEIGHTS)):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # stored transposed: (E, out, in / 32, 16)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            quantized[name] = t
    save_file(quantized, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quant / "config.json").write_text(json.dumps(config))
    return quant, plain


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _mxfp4_pair(None, tmp_path_factory)


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(pair):
    quant, plain = pair
    a, b = load_model(quant), load_model(plain)
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, p in params_a.items():
        assert torch.equal(p, params_b[name]), name
    # the quantization changed the experts: the test compares something
    original = load_model(write_demo_checkpoint(quant.parent / "original", arch="gpt_oss"))
    experts = "model.layers.0.mlp.experts.gate_up"
    assert not torch.equal(dict(original.named_parameters())[experts], params_a[experts])


def test_transformers_reads_the_mxfp4_checkpoint_alike(pair):
    """transformers' own MXFP4 dequantization (`Mxfp4Config(dequantize=True)`: its path without the GPU kernels)
    of the quantized checkpoint gives our logits."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import Mxfp4Config

    quant, _ = pair
    ref = AutoModelForCausalLM.from_pretrained(
        quant, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    ours = load_model(quant)
    prompt = torch.arange(3, 40)
    from shared.model.paged_attention import AttentionMetadata

    cfg = ours.config
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build([[2, 0, 3]], [len(prompt)], [len(prompt)], 16, windows=cfg.windows)
    with torch.no_grad():
        got = ours.logits(ours(prompt, torch.arange(len(prompt)), caches, meta))
        want = ref(prompt[None]).logits[0]
    assert (got - want).abs().max().item() < 1e-4


def test_other_quantization_is_refused_by_name(tmp_path):
    path = write_demo_checkpoint(tmp_path / "q", arch="gpt_oss")
    config = json.loads((path / "config.json").read_text()) | {"quantization_config": {"quant_method": "awq"}}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'awq'"):
        load_model(path)
