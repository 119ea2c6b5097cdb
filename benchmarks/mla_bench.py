"""Latent vs K|V caches: bytes per token and the hand-off of a long prompt, DeepSeek-V3-shaped vs Qwen3-MoE-shaped,
and MLA decode with and without absorption.

    .venv/bin/python benchmarks/mla_bench.py [--tokens 4096] [--repeats 5] [--decode-batch 4]
        [--decode-context 512] [--decode-steps 8] [--out JSON]

Two random-weight checkpoints of similar size, built here (in models/, reused when present), with the per-layer
attention of the published models at a smaller depth and width: 16 query heads of 128 over hidden 1024, 4 layers,
8 experts (top 2):
- Qwen3-MoE-shaped: 4 KV heads of 128 (Qwen3-30B-A3B and -235B-A22B: 4 x 128), K|V cache 2 x 4 x 128 values a
  layer;
- DeepSeek-V3-shaped: MLA with kv_lora_rank 512, qk_rope_head_dim 64, qk_nope 128, v 128 (V3's own), q_lora 384;
  latent cache 512 + 64 values a layer, one entry for all heads. First layer dense, the rest MoE.
Hand-off: benchmarks/kv_transfer_bench.py's machinery, for each model in the same run: a spawned prefill process
prefills the prompt, holds the KV and serves KvTransfer on 127.0.0.1; this process pulls it (`pull`: the whole
path, export + RPC + gloo; `raw`: the same bytes on a bare gloo pair), medians of --repeats.
Decode: the DeepSeek-V3-shaped engine, --decode-batch sequences of --decode-context prompt tokens, then the median
time of --decode-steps decode steps under MLAForm.ABSORBED and MLAForm.EXPANDED (the same tokens come out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import kv_transfer_bench  # noqa: E402
from host_info import cpu_info  # noqa: E402

from services.demo_model import write_demo_checkpoint  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_pool import KVLayout  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.config import ModelConfig  # noqa: E402
from shared.model.mla_attention import MLAForm  # noqa: E402

COMMON = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "max_position_embeddings": 8192,
}
SHAPES = {
    "qwen3_moe": COMMON
    | {
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 8,
        "moe_intermediate_size": 512,
        "mlp_only_layers": [],
    },
    "deepseek_v3": COMMON
    | {
        "num_key_value_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "intermediate_size": 1024,
        "n_routed_experts": 8,
        "moe_intermediate_size": 512,
        "first_k_dense_replace": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


def checkpoint(arch: str) -> Path:
    out = REPO / "models" / f"mla-bench-{arch}"
    if not (out / "tokenizer_config.json").is_file():
        print(f"writing {out} ...", flush=True)
        write_demo_checkpoint(out, arch=arch, size="small", overrides=SHAPES[arch])
    return out


def handoff(model_dir: Path, tokens: int, repeats: int) -> dict:
    """One kv_transfer_bench row for this model: bytes, pull and raw times, TTFT."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=kv_transfer_bench.prefill_main, args=(theirs, str(model_dir), [tokens], repeats))
    proc.start()
    try:
        info = ours.recv()
        (row,) = asyncio.run(kv_transfer_bench.measure(info, [tokens], repeats))
        ours.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    return row


def decode_speed(model_dir: Path, batch: int, context: int, steps: int, form: MLAForm) -> dict:
    """Median decode step time with `batch` sequences of `context` tokens, under `form`."""
    engine = Engine.from_dir(
        model_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=context, max_num_seqs=batch),
        num_kv_blocks=batch * (-(-(context + steps + 2) // 16)) + 4,
        max_model_len=context + steps + 2,
    )
    engine.model.set_mla_form(form)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(0, 256, (context,), generator=gen).tolist(), params)
        tokens[f"r{i}"] = []
    times = []
    while engine.has_unfinished():
        decoding = all(tokens.values())  # every prompt prefilled: this step decodes the whole batch
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    step = statistics.median(times)
    return {"form": form.value, "step_ms": step * 1e3, "tokens_per_s": batch / step, "steps": len(times),
            "tokens": [tokens[f"r{i}"] for i in range(batch)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mla.json"))
    args = parser.parse_args()
    models = {arch: checkpoint(arch) for arch in SHAPES}

    rows = []
    for arch, model_dir in models.items():
        mc = ModelConfig.from_dir(model_dir)
        layout = KVLayout.for_model(mc, 16, "float32")
        params = sum(t.numel() for t in _weights(model_dir))
        r = handoff(model_dir, args.tokens, args.repeats)
        rows.append({"arch": arch, "params": params, "kv_kind": layout.kind, "bytes_per_token": layout.bytes_per_token,
                     "values_per_token_layer": layout.planes * layout.num_kv_heads * layout.head_dim} | r)  # fmt: skip
    print(f"\nhand-off of a {args.tokens}-token prompt (float32 caches):")
    print("| model | params | cache | KV bytes/token | KV of the prompt | raw gloo | pull | TTFT | pull / TTFT |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['arch']}-shaped | {r['params'] / 1e6:.0f}M | {r['kv_kind']} ({r['values_per_token_layer']}/layer) "
              f"| {r['bytes_per_token']} | {r['bytes'] / 1e6:.1f} MB | {r['raw_ms']:.1f} ms | {r['pull_ms']:.1f} ms "
              f"| {r['ttft_ms']:.0f} ms | {r['pull_share_of_ttft']:.1%} |")  # fmt: skip

    decode = [
        decode_speed(models["deepseek_v3"], args.decode_batch, args.decode_context, args.decode_steps, form)
        for form in (MLAForm.ABSORBED, MLAForm.EXPANDED)
    ]
    same = decode[0].pop("tokens") == decode[1].pop("tokens")
    print(f"\nMLA decode, {args.decode_batch} sequences x {args.decode_context} context (same tokens: {same}):")
    print("| form | step | tokens/s |")
    print("| --- | ---: | ---: |")
    for d in decode:
        print(f"| {d['form']} | {d['step_ms']:.1f} ms | {d['tokens_per_s']:.1f} |")

    result = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        host=cpu_info(),
        args=vars(args),
        handoff=rows,
        decode=decode,
        decode_same_tokens=same,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _weights(model_dir: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).values())


if __name__ == "__main__":
    main()
