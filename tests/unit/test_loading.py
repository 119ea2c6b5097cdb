"""Checkpoint loading (single file, sharded, dtypes, clear errors) and the tokenizer / chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.demo_model import write_demo_checkpoint
from shared.model.config import UnsupportedModelError
from shared.model.experts import Experts
from shared.model.linear import PackedWeights, can_prepack, prepack
from shared.model.loader import CheckpointError, load_model
from shared.model.tokenizer import ChatTemplateError, Tokenizer


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def rewrite_single_file(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def qwen3_moe_ckpt(tmp_path_factory) -> Path:
    """A tiny float32 qwen3_moe checkpoint, single file. Read-only: tests that corrupt write their own."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", size="tiny", seed=0)


# ---- loading ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "llama", "glm4_moe"])
def test_single_file_and_sharded_checkpoints_load_identically(tmp_path, arch):
    single = write_demo_checkpoint(tmp_path / "single", arch=arch, size="tiny", seed=3)
    sharded = write_demo_checkpoint(tmp_path / "sharded", arch=arch, size="tiny", seed=3, max_shard_bytes=100_000)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert_same_parameters(load_model(single), load_model(sharded))


def test_parameters_hold_the_checkpoint_tensors(qwen3_moe_ckpt):
    raw = load_file(str(qwen3_moe_ckpt / "model.safetensors"))
    model = load_model(qwen3_moe_ckpt)
    params = dict(model.named_parameters())
    pre = "model.layers.0"
    q, k, v = (raw[f"{pre}.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(params[f"{pre}.self_attn.qkv_proj"], torch.cat([q, k, v]))
    assert torch.equal(params[f"{pre}.self_attn.o_proj"], raw[f"{pre}.self_attn.o_proj.weight"])
    gate_up = params[f"{pre}.mlp.experts.gate_up"]
    inter = raw[f"{pre}.mlp.experts.0.gate_proj.weight"].shape[0]
    for e in (0, 5):
        assert torch.equal(gate_up[e, :inter], raw[f"{pre}.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(gate_up[e, inter:], raw[f"{pre}.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(params[f"{pre}.mlp.experts.down"][e], raw[f"{pre}.mlp.experts.{e}.down_proj.weight"])
    assert torch.equal(params["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"], raw["lm_head.weight"])


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="oneDNN not available")
def test_prepack_packs_every_module_with_matmul_weights(qwen3_moe_ckpt):
    model = load_model(qwen3_moe_ckpt)
    packed_weights = [m for m in model.modules() if isinstance(m, PackedWeights) and m.LINEAR_WEIGHTS]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert packed_weights and experts
    assert prepack(model) == len([m for m in model.modules() if isinstance(m, PackedWeights)]) + len(experts)
    for module in packed_weights:
        assert all(module.w(name).is_mkldnn for name in module.LINEAR_WEIGHTS), type(module).__name__
    for module in experts:
        assert all(w.is_mkldnn for e in range(module.num_experts) for w in module.expert_weights(e))
    assert prepack(model) == 0  # once per model


def test_mixtral_checkpoint_names_map_to_experts(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "mixtral", arch="mixtral", size="tiny")
    raw = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.2.w1.weight" in raw
    params = dict(load_model(ckpt).named_parameters())
    pre = "model.layers.1"
    w1, w3, w2 = (raw[f"{pre}.block_sparse_moe.experts.2.{w}.weight"] for w in ("w1", "w3", "w2"))
    assert torch.equal(params[f"{pre}.mlp.experts.gate_up"][2], torch.cat([w1, w3]))
    assert torch.equal(params[f"{pre}.mlp.experts.down"][2], w2)
    assert torch.equal(params[f"{pre}.mlp.gate.weight"], raw[f"{pre}.block_sparse_moe.gate.weight"])


def test_checkpoint_dtype_is_the_default(tmp_path, qwen3_moe_ckpt):
    assert {p.dtype for p in load_model(qwen3_moe_ckpt).parameters()} == {torch.float32}
    bf16 = write_demo_checkpoint(tmp_path / "bf16", arch="qwen3_moe", size="tiny", dtype="bfloat16")
    assert {p.dtype for p in load_model(bf16).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(bf16, dtype="float32").parameters()} == {torch.float32}


def test_dtype_bfloat16_loads_bfloat16_parameters(qwen3_moe_ckpt):
    f32 = load_model(qwen3_moe_ckpt)
    bf16 = load_model(qwen3_moe_ckpt, dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ref = {k: v.to(torch.bfloat16) for k, v in state(f32).items()}
    got = state(bf16)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_dtype_may_be_a_torch_dtype(qwen3_moe_ckpt):
    assert {p.dtype for p in load_model(qwen3_moe_ckpt, dtype=torch.float16).parameters()} == {torch.float16}


def test_unsupported_dtype_is_rejected(qwen3_moe_ckpt):
    with pytest.raises(ValueError, match="int8") as exc:
        load_model(qwen3_moe_ckpt, dtype="int8")
    assert "bfloat16" in str(exc.value)


# ---- errors -------------------------------------------------------------------------------------------


def test_unsupported_model_type_names_the_supported_architectures(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(ckpt)
    message = str(exc.value)
    assert "gpt2" in message
    for arch in ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe"):
        assert arch in message


@pytest.mark.parametrize(
    ("arch", "deleted"),
    [
        ("qwen3_moe", "model.layers.0.self_attn.o_proj.weight"),
        ("qwen3_moe", "model.layers.1.self_attn.k_proj.weight"),  # one slice of a fused parameter
        ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight"),  # one slice of a stacked parameter
        ("qwen3_moe", "model.norm.weight"),
        # Mixtral spells expert tensors differently; the error should name the tensor the checkpoint lacks
        ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w1.weight"),
        ("glm4_moe", "model.layers.1.mlp.gate.e_score_correction_bias"),  # a buffer, loaded like a weight
        ("glm4_moe", "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ],
)
def test_missing_tensor_is_named(tmp_path, arch, deleted):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch=arch, size="tiny")
    rewrite_single_file(ckpt, lambda t: t.pop(deleted))
    with pytest.raises(CheckpointError, match="missing") as exc:
        load_model(ckpt)
    assert deleted in str(exc.value)


def test_multi_token_prediction_layers_are_skipped_and_other_strays_refused(tmp_path, caplog):
    """GLM-4.5 (like DeepSeek-V3) ships its MTP layer as model.layers.{num_hidden_layers}.*: skipped without
    a warning; a tensor of a layer index past the declared MTP layers is an error."""
    clean = write_demo_checkpoint(tmp_path / "clean", arch="glm4_moe", size="tiny")
    ckpt = write_demo_checkpoint(tmp_path / "mtp", arch="glm4_moe", size="tiny")
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1

    def add_mtp_layer(tensors):
        # the MTP layer: a decoder layer (a copy of layer 1's tensors) and its own projections and norms
        tensors |= {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k}
        tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
        tensors["model.layers.2.enorm.weight"] = torch.ones(64)
        tensors["model.layers.2.shared_head.head.weight"] = torch.zeros(259, 64)

    rewrite_single_file(ckpt, add_mtp_layer)
    with caplog.at_level("INFO", logger="shared.model.loader"):
        model = load_model(ckpt)
    assert_same_parameters(model, load_model(clean))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("multi-token-prediction" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
    stray = "model.layers.3.self_attn.o_proj.weight"  # no such layer, MTP or not: an error, not a warning
    rewrite_single_file(ckpt, lambda t: t.__setitem__(stray, torch.zeros(64, 64)))
    with pytest.raises(CheckpointError, match=f"{stray} matches no parameter"):
        load_model(ckpt)


def test_many_missing_tensors_are_summarized(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    rewrite_single_file(ckpt, lambda t: [t.pop(k) for k in list(t) if "layers.1." in k])
    with pytest.raises(CheckpointError, match=r"and \d+ more"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 64), (64, 63)),
        ("model.layers.1.self_attn.k_proj.weight", (32, 64), (33, 64)),
        ("model.layers.0.mlp.experts.7.down_proj.weight", (64, 32), (32, 64)),
        ("model.embed_tokens.weight", (259, 64), (300, 64)),
    ],
)
def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, name, good, bad):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")

    def edit(tensors):
        assert tuple(tensors[name].shape) == good
        tensors[name] = torch.zeros(bad)

    rewrite_single_file(ckpt, edit)
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    message = str(exc.value)
    assert name in message
    assert str(good) in message and str(bad) in message


def test_missing_shard_is_named(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny", max_shard_bytes=100_000)
    shards = sorted(ckpt.glob("model-*-of-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="missing") as exc:
        load_model(ckpt)
    assert shards[1].name in str(exc.value)
    assert shards[0].name not in str(exc.value)


def test_no_config_json(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ckpt)


def test_no_weights_at_all(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


# ---- tokenizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["héllo 世界 🙂", "plain ascii", "  leading spaces\nand\ttabs", "Ωμέγα ∑ 𝔘𝔫𝔦"])
def test_tokenizer_round_trips_text(qwen3_moe_ckpt, text):
    tok = Tokenizer(qwen3_moe_ckpt)
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_is_byte_level_for_multibyte_text(qwen3_moe_ckpt):
    tok = Tokenizer(qwen3_moe_ckpt)
    text = "héllo 世界 🙂"
    assert len(tok.encode(text)) == len(text.encode("utf-8"))  # one token per byte: no merges


def test_tokenizer_vocab_and_eos(qwen3_moe_ckpt):
    tok = Tokenizer(qwen3_moe_ckpt)
    cfg = json.loads((qwen3_moe_ckpt / "config.json").read_text())
    assert tok.vocab_size == cfg["vocab_size"] == 259
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == (cfg["eos_token_id"],)
    assert tok.id_to_token(cfg["eos_token_id"]) == "<|im_end|>"


def test_chat_template_renders_chatml(qwen3_moe_ckpt):
    tok = Tokenizer(qwen3_moe_ckpt)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo 世界<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without == rendered.removesuffix("<|im_start|>assistant\n")


def test_encode_chat_decodes_back_to_the_rendered_text(qwen3_moe_ckpt):
    tok = Tokenizer(qwen3_moe_ckpt)
    messages = [{"role": "user", "content": "héllo 世界 🙂"}]
    rendered = tok.apply_chat_template(messages)
    ids = tok.encode_chat(messages)
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    # the ChatML markers are single special tokens, not spelled out byte by byte
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1 and ids[0] == im_start[0]
    assert ids.count(im_start[0]) == 2
    assert ids.count(tok.eos_token_ids[0]) == 1
    # skipping specials leaves only the text
    assert tok.decode(ids) == "user\nhéllo 世界 🙂\nassistant\n"


def test_model_without_chat_template_raises(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer(ckpt)
    assert tok.chat_template is None
    assert tok.decode(tok.encode("still encodes")) == "still encodes"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_is_used_when_config_has_none(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    tok = Tokenizer(ckpt)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"


def test_chat_template_raise_exception_becomes_chat_template_error(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="qwen3_moe", size="tiny")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer(ckpt)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_named_chat_templates_use_the_default(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="llama")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    cfg_path.write_text(json.dumps(cfg))
    assert Tokenizer(ckpt).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
