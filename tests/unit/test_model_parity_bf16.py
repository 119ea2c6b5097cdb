"""Every supported architecture against transformers at bfloat16, on the same bfloat16 checkpoint.

Tolerances (measured on the tiny demo checkpoints: every architecture's prefill logits were bit-identical to
transformers', and greedy tokens equal except at exact ties; docs/model.md "bfloat16"):
- prefill logits: max |ours - transformers| ≤ 2 bfloat16 ulps of the largest logit's magnitude;
- greedy: the first MIN_EQUAL tokens of every prompt equal; past them the two may part only where
  transformers' own top two logits tie at bfloat16 resolution (either side may then break the tie).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.config import ARCHITECTURES
from shared.model.experts import Experts
from shared.model.kernels import cpu_moe
from shared.model.loader import load_model
from shared.model.moe import use_cpu_expert_kernel
from shared.model.paged_attention import AttentionMetadata

PROMPT_LENGTHS = (5, 23, 100)  # 100 > the prefill budget: chunked
NEW_TOKENS = 16
MIN_EQUAL = 8
BF16 = torch.bfloat16


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at magnitude x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


# Architectures not at bfloat16 parity (strict xfail: a fix turns it red until its entry is removed). gpt-oss
# left it after its RMSNorm scaled in float32, its routing weights in bfloat16 and o_proj's bias in the matmul.
KNOWN_BF16_GAPS: dict[str, str] = {}
ARCHS = [
    pytest.param(a, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BF16_GAPS[a])) if a in KNOWN_BF16_GAPS else a
    for a in sorted(ARCHITECTURES)
]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp(request.param), request.param, "tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=BF16)
    model.generation_config.eos_token_id = None
    return model.eval()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


# Architectures whose bfloat16 prefill logits (only) are off transformers' (strict xfail, as above). DeepSeek-V2
# left it once its RoPE used float32 cos/sin: the tables had been cast to bfloat16 with the model.
KNOWN_BF16_LOGIT_GAPS: dict[str, str] = {}


@pytest.mark.parametrize("expert_kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_bf16_prefill_logits_match_transformers(checkpoint, reference, request, expert_kernel):
    """With the torch paths, and with the CPU expert kernel's bfloat16 build computing the routed experts (where
    the architecture's experts take it: SiLU-gated, sizes that fit its panels; float32 accumulation, rounded to
    bfloat16 where torch rounds): the same tolerance."""
    model = load_model(checkpoint, dtype="bfloat16")
    if expert_kernel:
        if not cpu_moe.kernels():
            pytest.skip("the CPU expert kernel cannot be built or run on this host")
        line = use_cpu_expert_kernel(model)
        if "cpu kernel" not in line or " 0/" in line:
            pytest.skip(f"no routed experts on the kernel here: {line}")
    cfg = model.config
    if cfg.model_type in KNOWN_BF16_LOGIT_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_BF16_LOGIT_GAPS[cfg.model_type]))
    assert model.model.embed_tokens.weight.dtype == BF16
    prompt = torch.tensor(_prompts(cfg.vocab_size)[2])
    n, block = len(prompt), 16
    shape = (cfg.kv_planes, 8, block, cfg.num_kv_heads, cfg.kv_width)  # K|V, or MLA's one latent plane
    caches = [torch.zeros(shape, dtype=BF16) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build([[5, 0, 7, 2, 3, 1, 6]], [n], [n], block, windows=cfg.windows)
    with torch.no_grad():
        ours = model.logits(model(prompt, torch.arange(n), caches, meta)).float()
        ref = reference(prompt[None]).logits[0].float()
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 2 * bf16_ulp(scale)


def test_bf16_greedy_generation_matches_transformers(checkpoint, reference):
    engine = Engine.from_dir(
        checkpoint,
        dtype="bfloat16",
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        num_kv_blocks=64,
        max_model_len=512,
    )
    if cpu_moe.kernels():  # the routed experts run the kernel's bfloat16 build where they can
        for m in engine.model.modules():
            if isinstance(m, Experts) and m.cpu_kernel:
                assert m._panels is not None and m._panels.dtype == BF16
    prompts = _prompts(engine.model.config.vocab_size)
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, tokens in zip(prompts, ours, strict=True):
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        ref = out.sequences[0, len(prompt) :].tolist()
        parted = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None)
        if parted is None:
            continue
        assert parted >= MIN_EQUAL, f"prompt of {len(prompt)}: ours {tokens} vs transformers {ref}"
        top2 = out.scores[parted][0].float().topk(2).values
        assert (top2[0] - top2[1]).item() <= bf16_ulp(top2[0].item()), (
            f"prompt of {len(prompt)}: parted at token {parted} without a tie: ours {tokens}, transformers {ref}"
        )
