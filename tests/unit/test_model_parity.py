"""Every supported architecture against transformers on the same random checkpoint, in float32; and the
architectures whose configs can turn on sliding windows, with a window shorter than the prompts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.config import ARCHITECTURES
from shared.model.loader import load_model
from shared.model.moe import MoE
from shared.model.paged_attention import AttentionMetadata

PREFILL_BUDGET = 64
PROMPT_LENGTHS = (5, 23, 100, 41)  # 100 > PREFILL_BUDGET: that prompt is prefilled in chunks
NEW_TOKENS = 32


WINDOW = 16  # shorter than three of the four prompts
# arch → (config overrides that turn its sliding windows on, the per-layer windows transformers then applies:
# read from each modeling file, see shared/model/config.py layer_windows). gpt_oss's demo slides by default.
SLIDING = {
    "mixtral": ({"sliding_window": WINDOW}, (WINDOW, WINDOW)),
    "qwen3": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, (None, WINDOW)),
    "qwen2_moe": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}, (WINDOW, None)),
}
CASES = sorted(ARCHITECTURES) + [f"{arch}-window" for arch in SLIDING]


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    arch = request.param.removesuffix("-window")
    path = write_demo_checkpoint(tmp_path_factory.mktemp(request.param), arch=arch, size="tiny")
    if request.param.endswith("-window"):
        overrides, windows = SLIDING[arch]
        config = json.loads((path / "config.json").read_text()) | overrides
        (path / "config.json").write_text(json.dumps(config))
        assert load_model(path).config.layer_windows == windows
    if arch == "gpt_oss":  # its even layers slide (by its demo's layer_types, as by its config's default)
        assert load_model(path).config.layer_windows == (WINDOW, None)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does on our side
    return model.eval()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "plain"])  # both matmul weight formats
def test_greedy_generation_matches_transformers(checkpoint, reference, prepack):
    engine = Engine.from_dir(
        checkpoint,
        scheduler=SchedulerConfig(max_num_batched_tokens=PREFILL_BUDGET),
        num_kv_blocks=64,
        max_model_len=512,
        prepack_weights=prepack,
    )
    assert bool(engine.model.__dict__.get("prepacked")) == prepack
    prompts = _prompts(engine.model.config.vocab_size)
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert engine.stats.prefill_tokens == sum(PROMPT_LENGTHS)
    assert engine.stats.steps > NEW_TOKENS  # the long prompt took extra chunk steps
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert len(ref) == NEW_TOKENS  # no early stop at EOS: ignore_eos on our side
        assert tokens == ref
    engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prefill_logits_match_transformers(checkpoint, reference):
    model = load_model(checkpoint)
    cfg = model.config
    prompt = torch.tensor(_prompts(cfg.vocab_size)[2])
    n, block = len(prompt), 16
    caches = [torch.zeros(cfg.kv_planes, 8, block, cfg.num_kv_heads, cfg.kv_width) for _ in range(cfg.num_layers)]
    # Deliberately scattered blocks: the paged layout must not depend on contiguity.
    meta = AttentionMetadata.build([[5, 0, 7, 2, 3, 1, 6]], [n], [n], block, windows=cfg.windows)
    with torch.no_grad():
        ours = model.logits(model(prompt, torch.arange(n), caches, meta))
        ref = reference(prompt[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("num_tokens", [3, 37, 300])  # few experts hit; batched path; per-expert loop
def test_grouped_moe_matches_per_token_reference(checkpoint, num_tokens):
    model = load_model(checkpoint)
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    if not moes:
        pytest.skip("dense architecture")
    x = torch.randn(num_tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped, reference = moes[0](x), moes[0](x, reference=True)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)
    assert int(moes[0].expert_load.sum()) == 2 * num_tokens * model.config.num_experts_per_tok
