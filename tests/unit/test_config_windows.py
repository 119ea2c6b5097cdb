"""Per-layer sliding windows as transformers' own config classes (and their modeling files' use of them) say,
for configs that leave layer_types to the class defaults: which layers slide, and by how much."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from services.demo_model import demo_config
from shared.model.config import ModelConfig

LAYERS = 6
CASES = [
    ("gpt_oss", {"sliding_window": 8}),  # no layer_types: GptOssConfig's default alternation
    ("gpt_oss", {"sliding_window": 8, "layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 3}),
    ("mixtral", {"sliding_window": 8}),
    ("mixtral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 4}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 5}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
    ("qwen3_moe", {"use_sliding_window": False, "sliding_window": 8}),
    ("llama", {}),
    ("olmoe", {}),
]


def _transformers_windows(model_type: str, hf) -> tuple:
    """What each modeling file applies per layer (read from them: mixtral and qwen3_moe slide every layer by
    config.sliding_window; the others by layer_types; llama and olmoe build causal masks only)."""
    window = getattr(hf, "sliding_window", None)
    if model_type in ("llama", "olmoe") or not window:
        return ()
    if model_type in ("mixtral", "qwen3_moe"):
        return (window,) * LAYERS
    windows = tuple(window if t == "sliding_attention" else None for t in hf.layer_types)
    return windows if any(windows) else ()


@pytest.mark.parametrize(("model_type", "overrides"), CASES, ids=lambda c: str(c))
def test_layer_windows_follow_the_transformers_config_class(model_type, overrides):
    raw = demo_config(model_type) | {"num_hidden_layers": LAYERS} | overrides
    if model_type in ("qwen2_moe", "qwen3_moe"):
        raw["mlp_only_layers"] = []
    if model_type == "gpt_oss" and "layer_types" not in overrides:
        raw.pop("layer_types")
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    expected = _transformers_windows(model_type, hf)
    assert ModelConfig.from_dict(raw).layer_windows == expected
    if model_type == "gpt_oss" and "layer_types" not in overrides:
        assert expected == (8, None) * 3  # the default: even layers slide
