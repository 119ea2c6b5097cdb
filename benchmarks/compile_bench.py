"""What `torch.compile` gives a CPU decode step: the engine's model forward compiled against eager.

    .venv/bin/python benchmarks/compile_bench.py [--batch 32] [--steps 48] [--threads N] [--no-prepack]
        [--target model|layers] [--mode default|max-autotune-no-cudagraphs] [--expert-loop]

Two engines on the same checkpoint, one with its forward compiled (`--target model`: CausalLM.forward;
`layers`: each DecoderLayer's forward), each prefills the same B prompts of PROMPT tokens; after warm-up
steps (the compilation), blocks of BLOCK decode steps alternate between them (so drift on a shared machine
hits both), and the median step of each is printed, with the compile time and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402

PROMPT, WARMUP, BLOCK = 128, 6, 8


def build(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[Engine, dict]:
    engine = Engine.from_dir(
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.batch * PROMPT, max_num_seqs=args.batch),
        num_kv_blocks=args.batch * (-(-(PROMPT + args.steps + WARMUP + 16) // 16)),
        max_model_len=PROMPT + args.steps + WARMUP + 16,
        prepack_weights=not args.no_prepack,
    )
    params = SamplingParams(max_tokens=args.steps + WARMUP + 2, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return engine, {f"r{i}": [] for i in range(len(prompts))}


def step(engine: Engine, tokens: dict) -> float:
    t0 = time.perf_counter()
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    return time.perf_counter() - t0


def use_expert_loop(engine: Engine) -> None:
    """Plain weights through the per-expert loop instead of torch._grouped_mm, whose fake-tensor rule (torch
    2.13) accepts only bfloat16, so dynamo cannot trace it at float32."""
    for moe in engine.model.sparse_layers().values():
        ex = moe.experts
        ex.forward_grouped_mm = lambda x, ids, w, counts, ex=ex: ex.forward_grouped(x, ids, w, counts.tolist())


def compile_model(engine: Engine, target: str, mode: str) -> None:
    if target == "model":
        engine.model.forward = torch.compile(engine.model.forward, mode=mode, dynamic=True)
        return
    for layer in engine.model.model.layers:
        layer.forward = torch.compile(layer.forward, mode=mode, dynamic=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per engine")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-prepack", action="store_true")
    ap.add_argument("--target", choices=("model", "layers"), default="model")
    ap.add_argument("--mode", default="default")
    ap.add_argument("--expert-loop", action="store_true", help="plain weights: the per-expert loop (both engines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 259, (args.batch, PROMPT), generator=gen).tolist()
    eager, eager_tokens = build(model_dir, args, prompts)
    compiled, compiled_tokens = build(model_dir, args, prompts)
    if args.expert_loop:
        use_expert_loop(eager)
        use_expert_loop(compiled)
    compile_model(compiled, args.target, args.mode)
    t0 = time.perf_counter()
    for _ in range(1 + WARMUP):  # prefill, then decode steps: compiles the shapes that follow
        step(compiled, compiled_tokens)
    compile_s = time.perf_counter() - t0
    for _ in range(1 + WARMUP):
        step(eager, eager_tokens)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for b in range(args.steps // BLOCK):
        order = (("eager", eager, eager_tokens), ("compiled", compiled, compiled_tokens))[:: 1 if b % 2 == 0 else -1]
        for name, engine, tokens in order:
            times[name] += [step(engine, tokens) for _ in range(BLOCK)]
    e, c = (1000 * statistics.median(times[n]) for n in ("eager", "compiled"))
    same = sum(eager_tokens[r] == compiled_tokens[r] for r in eager_tokens) / len(eager_tokens)
    print(f"{args.batch} sequences, {args.threads} threads, prepack {'off' if args.no_prepack else 'on'}, "
          f"compiled {args.target} ({args.mode}), torch {torch.__version__}, load {os.getloadavg()[0]:.1f}: "
          f"eager {e:.2f} ms/step, compiled {c:.2f} ms/step ({e / c:.2f}x), compile + warm-up {compile_s:.0f} s, "
          f"same tokens {same:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
