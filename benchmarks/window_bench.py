"""Sliding windows on CPU: KV blocks held and decode speed of one model with and without a window.

    .venv/bin/python benchmarks/window_bench.py [--arch mixtral] [--size small] [--window 256]
                                                [--prompt-len 1024] [--max-tokens 128] [--requests 2] [--out JSON]

The same random checkpoint twice: as written (full attention) and with `sliding_window` set in its config
(Mixtral: every layer slides, so blocks behind the window are freed). Per run: the most KV blocks in use at
once, the blocks freed behind the window, prefill seconds, and decode tokens/s over the decode-only steps.
Prints a table and writes JSON (with the CPU model).

    .venv/bin/python benchmarks/window_bench.py --hybrid [--size small] [--prompt-len 4096] [--max-tokens 64]

Hybrid (gpt-oss-shaped: its demo's even layers slide over 128 tokens, odd ones are full): the same checkpoint
with one pool of every layer (as before KV cache groups: nothing can be freed) and with its KV cache groups
(shared/engine/kv_groups.py), in one process. Per run: KV bytes one request holds when it has decoded
(all groups), the bytes of its hand-off (a prefill engine's export of a held `--prompt-len` prompt), and decode
tokens/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from unittest import mock

from services.demo_model import write_demo_checkpoint
from shared.engine import kv_cache as kv_cache_module
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_groups import KVGroup
from shared.engine.sampling import SamplingParams


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


def one_pool(num_layers: int, layer_windows: tuple[int | None, ...]) -> tuple[KVGroup, ...]:
    """The grouping before KV cache groups: one pool of every layer, nothing freed (a hybrid model)."""
    return (KVGroup(tuple(range(num_layers)), None),)


def held_bytes(engine: Engine, request_id: str) -> int:
    """KV bytes `request_id` holds now, over every group (FREED entries hold nothing)."""
    tables = engine.scheduler.tables(engine.requests[request_id])
    pairs = zip(tables, engine.pools, strict=True)
    return sum(sum(b >= 0 for b in t.blocks) * pool.layout.bytes_per_block for t, pool in pairs)


def run_hybrid(model_dir: Path, args: argparse.Namespace) -> dict:
    """One request of prompt_len + max_tokens: bytes held once decoded, hand-off bytes, decode tok/s."""
    opts = dict(
        threads=args.threads,
        kv_cache_bytes=1 << 30,
        max_model_len=args.prompt_len + args.max_tokens,
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    prompt = [j % 250 + 3 for j in range(args.prompt_len)]
    prefill = Engine.from_dir(model_dir, **opts)
    prefill.add_request("h", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    handoff = prefill.export_kv("h").nbytes
    engine = Engine.from_dir(model_dir, **opts)
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    steps: list[float] = []
    held = 0
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - start)
        if "r" in engine.requests and engine.requests["r"].block_table:
            held = held_bytes(engine, "r")
    steps.sort()
    return {
        "groups": len(engine.pools),
        "held_mib": round(held / 2**20, 2),
        "handoff_mib": round(handoff / 2**20, 2),
        "decode_step_ms_median": round(1000 * steps[len(steps) // 2], 2) if steps else None,
    }


def main_hybrid(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_demo_checkpoint(Path(tmp) / "gpt_oss", arch="gpt_oss", size=args.size)
        with mock.patch.object(kv_cache_module, "kv_groups", one_pool):
            before = run_hybrid(model_dir, args)
        after = run_hybrid(model_dir, args)
    report = {"cpu": cpu_model(), "args": vars(args), "results": {"one pool": before, "groups": after}}
    print(f"{'run':10} {'groups':>7} {'held MiB':>9} {'hand-off MiB':>13} {'decode step ms':>15}")
    for name, r in report["results"].items():
        print(
            f"{name:10} {r['groups']:>7} {r['held_mib']:>9} {r['handoff_mib']:>13} {r['decode_step_ms_median']!s:>15}"
        )
    print(report["cpu"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


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
    parser.add_argument("--hybrid", action="store_true", help="gpt-oss: one pool against KV cache groups")
    args = parser.parse_args()
    if args.hybrid:
        return main_hybrid(args)
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
