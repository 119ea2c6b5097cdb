"""KV cache bytes per token of published checkpoints, computed from the layouts the engine would build.

    .venv/bin/python benchmarks/kv_bytes_table.py [--dtype bfloat16] [--out JSON]

Each row is a supported architecture's demo config with the attention shape of a published model (layers, KV
heads, head dim; MLA's latent widths) written over it, parsed by ModelConfig and laid out by KVLayout.for_model:
the same path as a serving engine, so the figure is what a pool holds and a hand-off moves per prompt token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.demo_model import demo_config  # noqa: E402
from shared.engine.kv_pool import KVLayout  # noqa: E402
from shared.model.config import ModelConfig  # noqa: E402

_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
# model → (architecture, the config fields that decide its cache), from the published config.json files
PUBLISHED: dict[str, tuple[str, dict]] = {
    "Llama-3.1-8B": ("llama", {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}),
    "Qwen2.5-7B": ("qwen2", {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4}),
    "Qwen3-8B": ("qwen3", {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8}),
    "Mixtral-8x7B": ("mixtral", {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}),
    "Qwen1.5-MoE-A2.7B": (
        "qwen2_moe",
        {"num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16},
    ),
    "Qwen3-30B-A3B": ("qwen3_moe", {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4}),
    "Qwen3-235B-A22B": ("qwen3_moe", {"num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4}),
    "OLMoE-1B-7B": ("olmoe", {"num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16}),
    "GLM-4.5-Air": ("glm4_moe", {"num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8}),
    "DeepSeek-V2-Lite": ("deepseek_v2", {"num_hidden_layers": 27, "num_attention_heads": 16} | _MLA),
    "DeepSeek-V2": ("deepseek_v2", {"num_hidden_layers": 60, "num_attention_heads": 128} | _MLA),
    "DeepSeek-V3": ("deepseek_v3", {"num_hidden_layers": 61, "num_attention_heads": 128} | _MLA),
}


def kv_bytes_per_token(arch: str, shape: dict, dtype: str) -> tuple[KVLayout, ModelConfig]:
    raw = demo_config(arch) | shape | {"head_dim": 128}
    if ModelConfig.from_dict(raw).mla:
        raw = raw | {"num_key_value_heads": shape["num_attention_heads"]}
        del raw["head_dim"]
    mc = ModelConfig.from_dict(raw)
    return KVLayout.for_model(mc, 16, dtype), mc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_bytes.json"))
    args = parser.parse_args()
    rows = []
    print(f"| model | architecture | layers | cache per layer and token | KV bytes / token ({args.dtype}) |")
    print("| --- | --- | ---: | --- | ---: |")
    for model, (arch, shape) in PUBLISHED.items():
        layout, mc = kv_bytes_per_token(arch, shape, args.dtype)
        if layout.kind == "latent":
            what = f"latent: 1 x ({mc.mla.kv_lora_rank} + {mc.mla.qk_rope_head_dim})" if mc.mla else ""
        else:
            what = f"K+V: 2 x {layout.num_kv_heads} heads x {layout.head_dim}"
        rows.append({"model": model, "arch": arch, "layers": layout.num_layers, "kind": layout.kind,
                     "bytes_per_token": layout.bytes_per_token})  # fmt: skip
        print(f"| {model} | {arch} | {layout.num_layers} | {what} | {layout.bytes_per_token:,} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
