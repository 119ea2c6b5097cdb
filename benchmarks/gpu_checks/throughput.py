"""Check 5: decode tokens/s of the `small` demo model at 32 sequences in bfloat16, ours (Engine) and
`transformers` (model.generate) on the same GPU, with the ratio. A measurement: it fails only if a side does
not run or does not produce every token. --allow-cpu: the tiny model in float32, 8 sequences, 4 steps.

Both sides decode the same prompts of PROMPT_TOKENS random tokens for `steps` new tokens, greedily, ignoring EOS.
Ours: the steps after the one that prefills every prompt are timed (each adds one token per sequence).
transformers: one generate(steps) after a warm-up, timed from the first generated token to the last by a stopping
criterion that records when each step ends (so the prefill is left out without subtracting two noisy runs).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from benchmarks.gpu_checks.common import CheckResult, Target, sync, verdict
from services.demo_model import write_demo_checkpoint
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams

NAME = "throughput"
PROMPT_TOKENS = 16


def check(target: Target) -> CheckResult:
    device = target.device()
    size, dtype, seqs, steps = ("tiny", "float32", 8, 4) if target.cpu else ("small", "bfloat16", 32, 128)
    ckpt = write_demo_checkpoint(Path(target.work_dir) / f"throughput-{size}", size=size)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (seqs, PROMPT_TOKENS), generator=gen)
    ours, produced = _ours(ckpt, dtype, device, prompts.tolist(), steps)
    theirs = _transformers(ckpt, dtype, device, prompts, steps)
    numbers = dict(ours_tokens_per_s=ours, transformers_tokens_per_s=theirs, ratio=ours / theirs)
    failures = [] if produced == seqs * steps else [f"ours produced {produced} of {seqs * steps} tokens"]
    details = (f"{size} demo model, {dtype}, {seqs} sequences of {PROMPT_TOKENS} prompt tokens, {steps} decode "
               f"steps on {device}; ratio = ours / transformers")  # fmt: skip
    return verdict(NAME, failures, numbers, details)


def _ours(ckpt: Path, dtype: str, device: str, prompts: list[list[int]], steps: int) -> tuple[float, int]:
    """(decode tokens/s, tokens produced) of one batch after a warm-up batch."""
    seqs = len(prompts)
    blocks = seqs * (-(-(PROMPT_TOKENS + steps) // 16) + 1)
    scheduler = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * PROMPT_TOKENS)
    engine = Engine.from_dir(ckpt, dtype=dtype, device=device, num_kv_blocks=blocks,
                             max_model_len=PROMPT_TOKENS + steps, scheduler=scheduler)  # fmt: skip
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(f"seq-{i}", prompt, params)
    produced = sum(len(out.new_token_ids) for out in engine.step())  # the prefill step: first tokens
    sync(device)
    t0 = time.perf_counter()
    timed = 0
    while engine.has_unfinished():
        timed += sum(len(out.new_token_ids) for out in engine.step())
    sync(device)
    return timed / (time.perf_counter() - t0), produced + timed


@torch.no_grad()
def _transformers(ckpt: Path, dtype: str, device: str, prompts: torch.Tensor, steps: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = prompts.to(device)

    step_ends: list[float] = []

    class StepClock(StoppingCriteria):
        """Called once per generated token, after its step: records when (never stops generation)."""

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
            sync(device)
            step_ends.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(n: int) -> None:
        step_ends.clear()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([StepClock()]))  # fmt: skip
        if out.shape != (len(ids), PROMPT_TOKENS + n):
            raise RuntimeError(f"transformers generated {tuple(out.shape)}, not {(len(ids), PROMPT_TOKENS + n)}")

    generate(4)  # warm-up
    generate(steps)
    if len(step_ends) != steps:
        raise RuntimeError(f"timed {len(step_ends)} steps of transformers, not {steps}")
    # step_ends[0] closes the prefill (the first token); each later entry one decode step of every sequence
    return len(ids) * (steps - 1) / (step_ends[-1] - step_ends[0])
