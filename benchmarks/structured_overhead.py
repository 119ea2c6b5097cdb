"""What constrained decoding costs a decode step, in the engine, on the demo model.

    .venv/bin/python benchmarks/structured_overhead.py [--size tiny|small] [--batch 8] [--steps 48]
        [--out benchmarks/results/structured_overhead.json]

The same batch of `--batch` requests (one prompt each, greedy, ignore_eos) decodes `--steps` tokens three ways:
unconstrained, every request under a regex, every request under a JSON Schema (both long enough that no request
finishes its grammar within the steps, so every step is masked). Reported per step (after 4 warm-up steps):
wall time; of it, what masking cost on the critical path (waiting for the mask fill after the forward + applying
the bitmask to the logits) and the fill time itself, which runs in a thread overlapping the forward. CPU only here;
not yet run on a GPU. Prints a table and writes JSON with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from shared.structured import spec as specs

WARMUP = 4
_ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
MODES = {
    "none": None,
    "regex": specs.regex("[a-z ,.]{1000}"),
    "json_schema": specs.json_schema({"type": "array", "items": _ITEM, "minItems": 200}),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run(engine: Engine, prompts: list[list[int]], spec, steps: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=steps + WARMUP + 1, temperature=0.0, ignore_eos=True, structured=spec)
    for i, p in enumerate(prompts):
        engine.add_request(f"{id(spec)}-{i}", p, params)
    engine.step()  # the prefill
    for _ in range(WARMUP):
        engine.step()
    stats = engine.structured.stats
    wait0, apply0, fill0, masked0 = stats.wait_s, stats.apply_s, stats.fill_s, stats.steps
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == len(prompts), "every request decodes every step"
    masked = stats.steps - masked0
    for i in range(len(prompts)):
        engine.abort(f"{id(spec)}-{i}")
    per = max(masked, 1)
    return {
        "step_ms": round(statistics.fmean(times) * 1e3, 3),
        "step_ms_p50": round(statistics.median(times) * 1e3, 3),
        "mask_wait_ms": round((stats.wait_s - wait0) / per * 1e3, 3),
        "mask_apply_ms": round((stats.apply_s - apply0) / per * 1e3, 3),
        "mask_fill_ms_overlapped": round((stats.fill_s - fill0) / per * 1e3, 3),
        "masked_steps": masked,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/structured_overhead.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_demo_checkpoint(Path(d) / "m", arch="qwen3_moe", size=args.size)
        tok = Tokenizer(ckpt)
        engine = Engine.from_dir(ckpt, max_model_len=1024, threads=args.threads)
        prompts = [tok.encode_chat([{"role": "user", "content": f"request {i}"}]) for i in range(args.batch)]
        rows = {name: run(engine, prompts, spec, args.steps) for name, spec in MODES.items()}
    base = rows["none"]["step_ms"]
    print(f"demo {args.size}, batch {args.batch}, {args.steps} steps, torch threads {args.threads}")
    print(f"{'mode':<12} {'step ms':>8} {'+ vs none':>10} {'wait ms':>8} {'apply ms':>9} {'fill ms (overlapped)':>21}")
    for name, r in rows.items():
        print(
            f"{name:<12} {r['step_ms']:>8.3f} {r['step_ms'] - base:>+10.3f} {r['mask_wait_ms']:>8.3f} "
            f"{r['mask_apply_ms']:>9.3f} {r['mask_fill_ms_overlapped']:>21.3f}"
        )
    result = {"cpu": cpu_model(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}; wrote {out}")


if __name__ == "__main__":
    main()
