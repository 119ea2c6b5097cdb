"""Deterministic random-weight checkpoints in Hugging Face format, for tests, benchmarks and offline demos.

The text such a model writes is meaningless; its shapes, routing and cost are those of the real
architecture. Weights are scaled so logits and router scores are well separated: greedy decoding then
does not hinge on float rounding, which makes token-for-token comparisons meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.model.config import ARCHITECTURES, ModelConfig
from shared.model.loader import DTYPES, checkpoint_name, checkpoint_targets
from shared.model.transformer import CausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen models use it; with `tools`, Qwen 2.5's Hermes-style tool calling: the tools in a system block,
# an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>, tool results as <tool_response> in a user
# turn. Without tools (and tool messages) it renders exactly the plain ChatML it always did.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    ' + \'<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": \''
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# gpt-oss's tiny demo: a window shorter than most test prompts (its even layers slide, its odd ones do not) and
# a YaRN ramp that falls inside the tiny head dimension (rotations between beta_slow and beta_fast)
GPT_OSS_WINDOW = 16
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 512,  # x factor = the tiny max_position
}
SIZES: dict[str, dict[str, int]] = {
    # a few million parameters: fast enough for every test
    "tiny": dict(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        experts=8,
        expert_intermediate=32,
        shared_intermediate=64,
        max_position=2048,
    ),
    # tiny with a single KV head (multi-query attention): fewer KV heads than a TP = 2 group's ranks, so each
    # rank holds a replica of it
    # ~100M parameters in total, ~30M active: big enough that benchmarks measure the model, not Python
    "small": dict(
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=2,
        head_dim=64,
        intermediate=1024,
        experts=8,
        expert_intermediate=1024,
        shared_intermediate=1024,
        max_position=8192,
    ),
}
# tiny with a single KV head (multi-query attention): fewer KV heads than a TP = 2 group's ranks, so each rank
# holds a replica of it
SIZES["tiny_mqa"] = SIZES["tiny"] | {"kv_heads": 1}


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens and three specials: any text round-trips, no training needed."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def demo_config(arch: str, size: str = "tiny") -> dict[str, Any]:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(sorted(ARCHITECTURES))}")
    if arch not in HF_CLASS:
        raise ValueError(f"no demo checkpoint is defined for {arch!r} (services/demo_model.py)")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    vocab = 256 + len(SPECIAL_TOKENS)
    eos = vocab - 1  # <|im_end|>
    cfg: dict[str, Any] = {
        "architectures": [HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": s["max_position"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": arch in ("qwen2", "qwen3"),
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "mixtral":
        cfg |= {
            "num_local_experts": s["experts"],
            "num_experts_per_tok": 2,
            "intermediate_size": s["expert_intermediate"],
            "sliding_window": None,
        }
    elif arch == "olmoe":
        cfg |= {
            "num_experts": s["experts"],
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "intermediate_size": s["expert_intermediate"],
            "clip_qkv": None,
        }
    elif arch in ("qwen2_moe", "qwen3_moe"):
        cfg |= {
            "num_experts": s["experts"],
            "num_experts_per_tok": 2,
            "moe_intermediate_size": s["expert_intermediate"],
            "decoder_sparse_step": 1,
            "norm_topk_prob": arch == "qwen3_moe",
            "use_sliding_window": False,
            # the last layer dense: exercises the interleaving both Qwen-MoE variants allow
            "mlp_only_layers": [s["layers"] - 1] if size.startswith("tiny") else [],
        }
        if arch == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = s["shared_intermediate"]
    elif arch in ("deepseek_v2", "deepseek_v3"):
        del cfg["head_dim"]  # the config class derives it (= qk_rope_head_dim); a written null breaks V3's YaRN
        cfg |= _deepseek_fields(arch, s)
    elif arch == "glm4_moe":
        # GLM-4.5's options: q/k/v bias, per-head q/k norm, half the head dims rotated, sigmoid routing with a
        # correction bias, scaled weights, one shared expert, the first layer dense, one MTP layer (its
        # tensors are not written: transformers would not load them)
        cfg |= {
            "n_routed_experts": s["experts"],
            "num_experts_per_tok": 2,
            "moe_intermediate_size": s["expert_intermediate"],
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "num_nextn_predict_layers": 1,
        }
    elif arch == "gpt_oss":
        cfg |= {
            "num_local_experts": s["experts"],
            "num_experts_per_tok": 2,
            "intermediate_size": s["expert_intermediate"],
            "sliding_window": GPT_OSS_WINDOW if size.startswith("tiny") else 128,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s["layers"])],
            "rope_parameters": GPT_OSS_ROPE,
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "rms_norm_eps": 1e-5,
        }
        del cfg["rope_theta"]
    return cfg


def _deepseek_fields(arch: str, s: dict[str, int]) -> dict[str, Any]:
    """MLA at the size's scale in DeepSeek-V3's proportions (latent = 4 x head_dim, rope = head_dim / 2: 512 and
    64 at its head_dim 128), YaRN as the published checkpoints
    write it (`rope_scaling`), V3 with compressed queries, V2 without (as V2-Lite)."""
    hd = s["head_dim"]
    v3 = arch == "deepseek_v3"
    return {
        # transformers repeats the expanded K/V by heads / num_key_value_heads: the checkpoints set them equal
        "num_key_value_heads": s["heads"],
        "q_lora_rank": 3 * hd // 2 if v3 else None,
        "kv_lora_rank": 4 * hd,
        "qk_nope_head_dim": hd,
        "qk_rope_head_dim": hd // 2,
        "v_head_dim": hd,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": s["max_position"] // 4,
            "beta_fast": 32,
            "beta_slow": 1,
            # V3's published values make YaRN's cos/sin factor 1 and scale the softmax by mscale^2; V2's
            # here differ so the cos/sin factor is exercised too
            "mscale": 1.0,
            "mscale_all_dim": 1.0 if v3 else 0.707,
        },
        "rope_interleave": True,
        "n_routed_experts": s["experts"],
        "num_experts_per_tok": 2,
        "moe_intermediate_size": s["expert_intermediate"],
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,  # a dense first layer, then MoE
        "routed_scaling_factor": 2.5 if v3 else 1.0,
        "norm_topk_prob": v3,
        "n_group": 4,
        "topk_group": 2,
        **({} if v3 else {"topk_method": "group_limited_greedy"}),
    }


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-named float32 tensors for `cfg`, reproducible from `seed`."""
    model_cfg = ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        model = CausalLM(model_cfg)
    gen = torch.Generator().manual_seed(seed)
    hidden = model_cfg.hidden_size
    tensors = {}
    for name, target in sorted(checkpoint_targets(model).items()):
        shape = tuple(target.param[target.index].shape)
        fan_in = shape[-1]
        if target.convert is not None and name.endswith(("gate_up_proj", "down_proj")):
            # gpt-oss's stacked experts: the checkpoint holds (E, in, out), our parameter (E, out, in)
            shape = (shape[0], shape[2], shape[1])
            fan_in = shape[1]
        w = torch.randn(shape, generator=gen)
        if "norm" in name:
            w = 1.0 + 0.1 * w
        elif name.endswith("bias"):
            w = 0.1 * w
        elif name == "lm_head.weight" or name.endswith("mlp.gate.weight"):
            w = w * (4.0 / hidden**0.5)  # logits / router scores with std ~4: clear winners
        elif "embed_tokens" not in name and "sinks" not in name:
            w = w / fan_in**0.5
        tensors[checkpoint_name(model_cfg.model_type, name)] = w.contiguous()
    return tensors


def ensure_demo_checkpoint(out_dir: str | Path, arch: str = "qwen3_moe", size: str = "tiny") -> Path:
    """The demo checkpoint at `out_dir`, written first if missing or incomplete (tokenizer_config.json is
    written last: its presence means an earlier write completed)."""
    out = Path(out_dir)
    if not (out / "tokenizer_config.json").is_file():
        print(f"writing the {size} {arch} demo checkpoint to {out} ...", flush=True)
        write_demo_checkpoint(out, arch=arch, size=size)
    return out


def write_demo_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write config, weights (sharded when `max_shard_bytes` is set), tokenizer and chat template. `overrides`
    replace config fields (benchmarks shape a model after a published one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(arch, size) | {"torch_dtype": dtype} | (overrides or {})
    tensors = {k: v.to(DTYPES[dtype]) for k, v in random_weights(cfg, seed).items()}
    _write_weights(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = cfg["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2))
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg["max_position_embeddings"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return out


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
