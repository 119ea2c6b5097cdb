"""Sliding windows on CPU: KV blocks held and decode speed of one model with and without a window.

    .venv/bin/python benchmarks/window_bench.py [--arch mixtral] [--size small] [--window 256]
                                                [--prompt-len 1024] [--max-tokens 128] [--requests 2] [--out JSON]

The same random checkpoint twice: as written (full attention) and with `sliding_window` set in its config
(Mixtral: every layer slides, so blocks behind the window are freed). Per run: the most KV blocks in use at
once, the blocks freed behind the window, prefill seconds, and decode tokens/s over the decode-only steps.
Prints a table and writes JSON (with the CPU model).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.demo import write_demo_checkpoint


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(model_dir: Path, args: argparse.Namespace) -> dict:
    engine = Engine.from_dir(
        model_dir,
        threads=args.threads,
        num_kv_blocks=args.requests * -(-(args.prompt_len + args.max_tokens) // 16) + 8,
        max_model_len=args.prompt_len + args.max_tokens,
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = [(7 * i + j) % 250 + 3 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    peak = 0
    prefill_s = decode_s = 0.0
    decode_tokens = 0
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
        start = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - start
        if decoding and engine.scheduler.running:
            decode_s += took
            decode_tokens += len(outputs)
        else:
            prefill_s += took
        peak = max(peak, engine.blocks.num_blocks - engine.blocks.num_free)
    return {
        "window": engine.model.config.freeable_window,
        "peak_blocks": peak,
        "freed_behind_window": engine.scheduler.freed_behind_window,
        "prefill_s": round(prefill_s, 3),
        "decode_tok_s": round(decode_tokens / decode_s, 1) if decode_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mixtral")
    parser.add_argument("--size", default="small")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full = write_demo_checkpoint(Path(tmp) / "full", arch=args.arch, size=args.size)
        windowed = write_demo_checkpoint(Path(tmp) / "windowed", arch=args.arch, size=args.size)
        config = json.loads((windowed / "config.json").read_text())
        config |= {"sliding_window": args.window, "use_sliding_window": True}
        (windowed / "config.json").write_text(json.dumps(config))
        results = {"full": run(full, args), "windowed": run(windowed, args)}
    report = {"cpu": cpu_model(), "args": vars(args), "results": results}
    print(f"{'run':10} {'window':>7} {'peak blocks':>12} {'freed':>7} {'prefill s':>10} {'decode tok/s':>13}")
    for name, r in results.items():
        print(
            f"{name:10} {r['window']!s:>7} {r['peak_blocks']:>12} {r['freed_behind_window']:>7} "
            f"{r['prefill_s']:>10} {r['decode_tok_s']!s:>13}"
        )
    print(report["cpu"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
