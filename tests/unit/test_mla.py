"""Multi-head latent attention: its two forms agree, YaRN as transformers computes it, the latent cache layout.

Parity of whole DeepSeek models against transformers is in test_model_parity.py (parametrized over ARCHITECTURES);
these are the pieces it does not isolate."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.demo_model import demo_config, write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout, KVPool
from shared.engine.sampling import SamplingParams
from shared.kv.reslice import IncompatibleKv, check_compatible, group_record, plan_pulls, record_layout
from shared.model.config import ModelConfig
from shared.model.kernels.choice import KernelChoice
from shared.model.layers import Rotary
from shared.model.loader import load_model
from shared.model.mla_attention import MLAForm
from shared.model.paged_attention import AttentionMetadata


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("v3"), arch="deepseek_v3", size="tiny")


def _prompts(vocab: int, lengths=(7, 90, 3)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_absorbed_and_expanded_forms_generate_the_same_tokens(v3):
    """Chunked prefill (90 > the budget of 32) then decode, under each form: same greedy tokens. The AUTO form
    mixes them (decodes absorbed, short chunks absorbed, long ones expanded)."""
    outputs = {}
    for form in MLAForm:
        engine = Engine.from_dir(
            v3, scheduler=SchedulerConfig(max_num_batched_tokens=32), num_kv_blocks=64, max_model_len=256
        )
        engine.model.set_mla_form(form)
        prompts = _prompts(engine.model.config.vocab_size)
        outputs[form] = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        assert engine.layout.planes == 1 and engine.layout.num_kv_heads == 1
        assert engine.pool.tensor.shape[1] == 1 and engine.pool.tensor.shape[4] == 1
    assert outputs[MLAForm.ABSORBED] == outputs[MLAForm.EXPANDED] == outputs[MLAForm.AUTO]


@pytest.mark.parametrize("form", [MLAForm.ABSORBED, MLAForm.EXPANDED])
def test_a_later_chunk_attends_over_the_cached_latent(v3, form):
    """Logits of the last 5 tokens computed as a second chunk over 20 cached tokens, in either form, equal those of
    one 25-token prefill in the expanded form (transformers' own computation): the later chunk reads the first
    chunk's latent from the paged cache."""
    model = load_model(v3)
    model.set_mla_form(MLAForm.EXPANDED)
    cfg = model.config
    ids = torch.tensor(_prompts(cfg.vocab_size, (25,))[0])
    block, blocks = 8, [3, 0, 2, 1]

    def caches():
        return [torch.zeros(cfg.kv_planes, 4, block, cfg.num_kv_heads, cfg.kv_width) for _ in range(cfg.num_layers)]

    with torch.no_grad():
        whole = model.logits(
            model(ids, torch.arange(25), caches(), AttentionMetadata.build([blocks], [25], [25], block))
        )
        model.set_mla_form(form)
        kv = caches()
        model(ids[:20], torch.arange(20), kv, AttentionMetadata.build([blocks], [20], [20], block))
        tail = model.logits(
            model(ids[20:], torch.arange(20, 25), kv, AttentionMetadata.build([blocks], [25], [5], block))
        )
    torch.testing.assert_close(tail, whole[20:], rtol=0, atol=1e-4)


def test_rope_interleave_off_matches_transformers(tmp_path):
    """DeepSeek-V3 with rope_interleave=false uses the rotate-half layout: prefill logits as transformers'."""
    ckpt = write_demo_checkpoint(tmp_path, arch="deepseek_v3", size="tiny")
    cfg_path = ckpt / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"rope_interleave": False}))
    model = load_model(ckpt)
    assert model.config.mla is not None and not model.config.mla.rope_interleave
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    cfg = model.config
    ids = torch.tensor(_prompts(cfg.vocab_size, (40,))[0])
    kv = [torch.zeros(1, 8, 8, 1, cfg.kv_width) for _ in range(cfg.num_layers)]
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(40), kv, AttentionMetadata.build([list(range(5))], [40], [40], 8)))
        theirs = ref(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "mscale": 0.9},
    ],
    ids=["v3-published", "betas", "mscale-only"],
)
def test_yarn_tables_and_scales_match_transformers(tmp_path, scaling):
    raw = demo_config("deepseek_v3") | {"rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_dict(raw)
    rotary = Rotary(cfg.head_dim, 64, cfg.rope)
    rotary.fill()
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    torch.testing.assert_close(rotary.cos, emb.cos() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.sin, emb.sin() * attention_factor, rtol=0, atol=1e-6)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    qk = cfg.mla.qk_head_dim if cfg.mla else 0
    assert qk**-0.5 * cfg.rope.softmax_scale_factor == pytest.approx(yarn_apply_mscale(hf.rope_parameters, qk**-0.5))


def test_latent_layout_shape_bytes_and_fingerprint():
    cfg = ModelConfig.from_dict(demo_config("deepseek_v3"))
    mla = cfg.mla
    assert mla is not None and cfg.kv_planes == 1 and cfg.num_kv_heads == 1
    latent = KVLayout(cfg.num_layers, 1, cfg.kv_width, 16, "float32", planes=1)
    assert latent.kind == "latent" and latent.block_shape(3) == (
        2,
        1,
        3,
        16,
        1,
        mla.kv_lora_rank + mla.qk_rope_head_dim,
    )
    assert latent.bytes_per_token == cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert KVPool(latent, 3).tensor.shape == latent.block_shape(3)
    # a K|V cache of the same entry width is a different cache: the fingerprints must not match
    same_width = KVLayout(cfg.num_layers, 1, cfg.kv_width, 16, "float32")
    assert same_width.fingerprint != latent.fingerprint
    assert same_width.bytes_per_token == 2 * latent.bytes_per_token
    with pytest.raises(ValueError, match="planes"):
        KVLayout(2, 1, 8, 16, "float32", planes=3)


def test_a_latent_cache_is_one_replicated_head_under_tensor_parallelism():
    """Every rank of a TP group holds the whole latent; each decode rank pulls it whole from one prefill rank,
    and a latent record never passes for a K|V one of the same widths."""
    latent = KVLayout(2, 1, 40, 16, "float32", planes=1)
    record = group_record(latent, 2, ["a:1", "b:2"])
    assert [r.kv_heads for r in record.ranks] == [[0], [0]] and record.planes == 1
    assert record_layout(record).fingerprint == latent.fingerprint
    for dst_tp in (1, 2, 4):
        for rank in range(dst_tp):
            (pull,) = plan_pulls(1, 2, dst_tp, rank)
            assert list(pull.heads) == [0] and list(pull.dst) == [0]
        check_compatible(record, latent, dst_tp)
    with pytest.raises(IncompatibleKv, match="planes"):
        check_compatible(record, KVLayout(2, 1, 40, 16, "float32"), 2)


def test_decode_over_the_kernel_step_layout_equals_the_torch_buckets(v3):
    """A step laid out for the Triton kernels (one KernelDecodes, no buckets: what a CUDA engine builds) is
    attended by MLA in torch as one padded group: the same logits as the torch path's buckets, and absorbed
    decode the same as the expanded form."""
    model = load_model(v3)
    cfg = model.config
    block = 4
    lens = [9, 3, 14]  # context lengths of three decode sequences, scattered over the pool's blocks
    tables = [[5, 1, 7], [2], [0, 3, 4, 6]]
    ids = torch.tensor(_prompts(cfg.vocab_size, (3,))[0])
    kv = [torch.randn(cfg.kv_planes, 8, block, 1, cfg.kv_width, generator=torch.Generator().manual_seed(i))
          for i in range(cfg.num_layers)]  # fmt: skip
    positions = torch.tensor([n - 1 for n in lens])
    logits = {}
    model.set_mla_form(MLAForm.EXPANDED)  # the reference: transformers' computation, over the torch buckets
    with torch.no_grad():
        meta = AttentionMetadata.build(tables, lens, [1, 1, 1], block)
        reference = model.logits(model(ids, positions, [c.clone() for c in kv], meta))
    model.set_mla_form(MLAForm.AUTO)  # decode absorbed
    for kernels in (KernelChoice.TORCH, KernelChoice.TRITON):
        meta = AttentionMetadata.build(tables, lens, [1, 1, 1], block, kernels=kernels)
        assert (meta.kernel_decodes is not None) == (kernels is KernelChoice.TRITON)
        with torch.no_grad():
            logits[kernels] = model.logits(model(ids, positions, [c.clone() for c in kv], meta))
    torch.testing.assert_close(logits[KernelChoice.TRITON], logits[KernelChoice.TORCH], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[KernelChoice.TORCH], reference, rtol=0, atol=1e-4)
