"""Check 1: every architecture against `transformers` on the same device, greedy, on tiny random checkpoints
(the method of tests/unit/test_model_parity.py, moved onto the device and into bfloat16).

float32: the generated tokens are identical, and prefill logits differ by at most F32_MAX_LOGIT_DIFF.
bfloat16: the two sides may round differently, so greedy paths can part at a near-tie, and in a MoE one
near-tied router score sends a token to another expert, which moves that token's logits by whole units (seen
on CPU: mixtral's bf16 prefill logits differ by up to 3.1 at one position in 100, mean 0.024, where every
other architecture matches transformers bit for bit). So bfloat16 is held to: the first BF16_EXACT_TOKENS
tokens of every prompt identical, the prefill argmax equal at BF16_MIN_ARGMAX_AGREE of positions, and the
mean |logit difference| (logits have std ~4, services/demo_model.py) at most BF16_MAX_MEAN_LOGIT_DIFF. The
max difference and the fraction of all tokens equal are reported, not held.
Under --allow-cpu only ARCHS_ON_CPU run (one dense, one MoE), with fewer tokens: the full set takes minutes
on a small CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.gpu_checks.common import CheckResult, Target, max_diff, verdict
from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.config import ARCHITECTURES
from shared.model.loader import load_model
from shared.model.paged_attention import AttentionMetadata

NAME = "parity"
PROMPT_LENGTHS = (5, 23, 100, 41)  # 100 > the prefill budget of 64: that prompt is prefilled in chunks
F32_MAX_LOGIT_DIFF = 1e-3
BF16_EXACT_TOKENS = 4
BF16_MIN_ARGMAX_AGREE = 0.95
BF16_MAX_MEAN_LOGIT_DIFF = 0.1
ARCHS_ON_CPU = ("llama", "qwen3_moe")


def check(target: Target) -> CheckResult:
    device = target.device()
    new_tokens = 8 if target.cpu else 32
    archs = ARCHS_ON_CPU if target.cpu else tuple(sorted(ARCHITECTURES))
    numbers: dict[str, dict] = {}
    failures: list[str] = []
    for arch in archs:
        ckpt = write_demo_checkpoint(Path(target.work_dir) / f"parity-{arch}", arch=arch, size="tiny")
        numbers[arch] = {}
        for dtype in ("float32", "bfloat16"):
            row, why = _compare(ckpt, dtype, device, new_tokens)
            numbers[arch][dtype] = row
            failures += [f"{arch} {dtype}: {w}" for w in why]
    bounds = (f"float32: tokens identical, prefill logits within {F32_MAX_LOGIT_DIFF}; bfloat16: first "
              f"{BF16_EXACT_TOKENS} tokens of each of {len(PROMPT_LENGTHS)} prompts identical, prefill argmax "
              f"equal at >= {BF16_MIN_ARGMAX_AGREE:.0%} of positions, mean |logit diff| <= "
              f"{BF16_MAX_MEAN_LOGIT_DIFF}; {new_tokens} greedy tokens per prompt on {device}; architectures: "
              f"{', '.join(archs)}" + (" (a subset: --allow-cpu)" if target.cpu else ""))  # fmt: skip
    return verdict(NAME, failures, numbers, bounds)


def _compare(ckpt: Path, dtype: str, device: str, new_tokens: int) -> tuple[dict, list[str]]:
    """(numbers, failures) of ours against transformers for one checkpoint and dtype."""
    torch_dtype = getattr(torch, dtype)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch_dtype).to(device).eval()
    ref.generation_config.eos_token_id = None  # the full length, as ignore_eos on our side
    engine = Engine.from_dir(ckpt, dtype=dtype, device=device, num_kv_blocks=64, max_model_len=512,
                             scheduler=SchedulerConfig(max_num_batched_tokens=64))  # fmt: skip
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    theirs = [_hf_greedy(ref, p, new_tokens, device) for p in prompts]
    equal = sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))
    leading = min(_common_prefix(o, t) for o, t in zip(ours, theirs, strict=True))
    logits = _prefill_logits(ckpt, ref, prompts[2], dtype, device)
    row = dict(tokens_equal=equal / (new_tokens * len(prompts)), min_leading_equal=leading, **logits)
    failures = []
    if dtype == "float32":
        if ours != theirs:
            failures.append(f"tokens differ (first mismatch after {leading} tokens)")
        if logits["max_logit_diff"] > F32_MAX_LOGIT_DIFF:
            failures.append(f"logits differ by {logits['max_logit_diff']:.2e}")
    else:
        if leading < BF16_EXACT_TOKENS:
            failures.append(f"a prompt's tokens differ after {leading}")
        if logits["argmax_agree"] < BF16_MIN_ARGMAX_AGREE:
            failures.append(f"prefill argmax equal at only {logits['argmax_agree']:.0%} of positions")
        if logits["mean_logit_diff"] > BF16_MAX_MEAN_LOGIT_DIFF:
            failures.append(f"mean logit difference {logits['mean_logit_diff']:.3f}")
    return row, failures


def _hf_greedy(ref, prompt: list[int], new_tokens: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def _prefill_logits(ckpt: Path, ref, prompt: list[int], dtype: str, device: str) -> dict[str, float]:
    """One prompt's prefill logits, ours over scattered KV blocks against transformers: max and mean |difference|
    and the fraction of positions whose argmax agrees."""
    model = load_model(ckpt, dtype=dtype, device=device)
    cfg = model.config
    n, block = len(prompt), 16
    caches = [torch.zeros(2, 8, block, cfg.num_kv_heads, cfg.head_dim, dtype=getattr(torch, dtype), device=device)
              for _ in range(cfg.num_layers)]  # fmt: skip
    meta = AttentionMetadata.build([[5, 0, 7, 2, 3, 1, 6]], [n], [n], block, device=device, windows=cfg.windows)
    tokens = torch.tensor(prompt, device=device)
    ours = model.logits(model(tokens, torch.arange(n, device=device), caches, meta)).float()
    theirs = ref(tokens[None]).logits[0].float()
    return dict(max_logit_diff=max_diff(ours, theirs), mean_logit_diff=(ours - theirs).abs().mean().item(),
                argmax_agree=(ours.argmax(-1) == theirs.argmax(-1)).float().mean().item())  # fmt: skip
