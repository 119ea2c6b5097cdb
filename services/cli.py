"""`pdserve` command line: demo checkpoints and single-process generation (the services come next)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from shared.model.config import ARCHITECTURES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo-model", help="write a deterministic random-weight checkpoint (HF format)")
    demo.add_argument("out_dir")
    demo.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHITECTURES))
    demo.add_argument("--size", default="tiny", choices=["tiny", "small"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    demo.add_argument("--max-shard-bytes", type=int, default=None, help="split the weights into shards")
    demo.set_defaults(func=_demo_model)

    gen = sub.add_parser("generate", help="generate text in this process (no services)")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True, help="checkpoint directory")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=_generate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


def _demo_model(args: argparse.Namespace) -> int:
    from shared.model.demo import write_demo_checkpoint

    out = write_demo_checkpoint(args.out_dir, args.arch, args.size, args.seed, args.dtype, args.max_shard_bytes)
    print(f"wrote a random-weight {args.size} {args.arch} checkpoint to {out} (its text is meaningless)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from shared.engine.engine import Engine
    from shared.engine.sampling import SamplingParams
    from shared.model.detokenizer import IncrementalDetokenizer
    from shared.model.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    tokenizer = Tokenizer(args.model)
    prompt_ids = (
        tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else tokenizer.encode(args.prompt)
    )
    engine = Engine.from_dir(args.model, dtype=args.dtype)
    detok = IncrementalDetokenizer(tokenizer)
    engine.add_request("cli", prompt_ids, params)
    start = time.perf_counter()
    first_token_at = None
    finish_reason = None
    while engine.has_unfinished():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            for tid in out.new_token_ids:
                delta = detok.add(tid)
                if not args.json:
                    print(delta, end="", flush=True)
            if out.finished:
                finish_reason = out.finish_reason.value
    tail = detok.flush()
    elapsed = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": prompt_ids,
                    "token_ids": detok.token_ids,
                    "text": detok.text,
                    "finish_reason": finish_reason,
                    "ttft_s": round((first_token_at or start) - start, 4),
                    "total_s": round(elapsed, 4),
                },
                ensure_ascii=False,
            )
        )
    else:
        print(tail)
        n = len(detok.token_ids)
        print(f"[{n} tokens in {elapsed:.2f}s, finish_reason={finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
