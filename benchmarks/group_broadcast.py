"""The per-step cost a worker group's op stream adds on the leader: step-input broadcast time and bytes per
step, and decode step time of a TP-2 group (replicated models) against a single engine, side by side.

    PYTHONPATH=. python benchmarks/group_broadcast.py --out group_broadcast.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.parallel.group_engine import start_group


def _decode_s(engine: Engine, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", list(range(5, 37)), params)
    engine.step()  # the prefill
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="group_broadcast.json")
    args = ap.parse_args()
    model = write_demo_checkpoint(tempfile.mkdtemp() + "/demo", arch="qwen3_moe", size="tiny")
    cfg = EngineConfig(model=str(model), threads=1, max_model_len=256, num_kv_blocks=256)
    single = _decode_s(Engine.build(cfg), args.batch, args.tokens)
    group = start_group(EngineConfig(**{**cfg.__dict__, "tp": 2}))
    try:
        grouped = _decode_s(group.engine, args.batch, args.tokens)
        cost = group.ops.cost
        result = {
            "batch": args.batch,
            "single_step_ms": 1e3 * single,
            "group_step_ms": 1e3 * grouped,
            "broadcast_us_per_step": cost.mean_us,
            "broadcast_bytes_per_step": cost.bytes / max(cost.steps, 1),
        }
    finally:
        group.close()
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
