"""Prefill and decode throughput of pdserve's engine against Hugging Face transformers, on CPU.

    .venv/bin/python benchmarks/engine_bench.py [--model DIR] [--out JSON] [--threads N] [--quick]
        [--prepack on|off|both | --no-prepack] [--cpu-kernel on|off|both] [--cpu-attention on|off|both]
        [--decode-tokens N] [--repeats N] [--skip-mixed] [--dtype float32,bfloat16,int8]

Both systems run in one process on the same checkpoint, dtype and thread count. Repeats of the two are
interleaved (and their order alternated) so that drift in a shared machine's speed hits both alike; each
number is the median over repeats, after one warm-up run each.

- prefill: B random prompts of PREFILL_LEN tokens, up to the first token's logits. pdserve: one engine
  step of B max_tokens=1 requests (the token budget fits the whole batch, so it is one batched prefill).
  transformers: one forward over (B, PREFILL_LEN) with use_cache=True and logits_to_keep=1.
- decode: B random prompts of DECODE_PROMPT tokens, then DECODE_TOKENS greedy tokens each after the
  first (ignore_eos). Only the decode phase is timed. pdserve: the engine steps after every request
  has its first token. transformers: one `generate`, timed from inside by a logits processor that
  stamps each step, from the first token's stamp to the last one's (so no prefill is subtracted).
- mixed decode (pdserve only): 31 prompts of MIXED_SHORT tokens + 1 of MIXED_LONG, against 32 of MIXED_SHORT,
  MIXED_TOKENS decode steps each, the two runs alternated: the median step of each and their ratio. It shows
  what one long sequence costs a batch of short ones (decode attention pads only within length buckets, and
  the CPU attention kernel reads each sequence's own blocks). With --cpu-attention both it runs for the
  first system with the kernel and its twin without, all four runs alternated.
- weights (--dtype, a comma-separated list): each pdserve system once per weight format, named `<system>@<format>`:
  float32, bfloat16 (the model in bfloat16: weights, activations, KV) or int8 (load-time weight-only int8,
  float32 activations and KV; shared/model/int8.py). transformers runs in the first format's dtype (int8: float32),
  so `same tokens` of the others against it measures their agreement with it, not a fault.
- floor: the bytes a decode step must read (weights of the experts it touches, KV), over this machine's
  read bandwidth; also its FLOPs over the machine's matmul rate, since CPUs are often compute bound here.
  Both rates are sampled once per round of each decode batch, between the systems' runs, and the floor uses
  their medians: a shared host's bandwidth moves by half from one minute to the next.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

from benchmarks.host_info import cpu_info, describe, load_average, matmul_gflops, read_bandwidth  # noqa: E402
from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from shared.engine.config import SchedulerConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.model.kernels import cpu_moe  # noqa: E402
from shared.model.moe import use_cpu_expert_kernel  # noqa: E402

PREFILL_LEN = 512
DECODE_PROMPT = 128
DECODE_TOKENS = 128  # timed tokens per sequence, after the first
RATES = "_host_rates"  # bench_decode's pseudo-system: the read bandwidth and matmul rate, sampled each round
BLOCK_SIZE = 16
MIXED_SHORT, MIXED_LONG, MIXED_BATCH, MIXED_TOKENS = 128, 4096, 32, 16
MODEL_FIELDS = ("model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size")  # fmt: skip


def prepare_model(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    return ensure_demo_checkpoint(REPO / "models" / "demo-small-qwen3_moe", size="small")


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class PdserveRunner:
    def __init__(
        self,
        model_dir: Path,
        prefill_batch: int,
        decode_batch: int,
        prepack: bool = True,
        cpu_kernel: bool = True,
        kernel_isa: str | None = None,
        cpu_attention: bool = True,
        weights: str | None = None,
    ) -> None:
        """kernel_isa: the expert kernel's build (cpu_moe.ISAS) instead of the widest this CPU runs. weights: a
        dtype, or int8 (float32 with load-time int8); None = the checkpoint's own dtype."""
        blocks = max(
            _blocks(PREFILL_LEN + 1) * prefill_batch,
            _blocks(DECODE_PROMPT + DECODE_TOKENS + 1) * decode_batch,
            _blocks(MIXED_SHORT + MIXED_TOKENS + 1) * (MIXED_BATCH - 1) + _blocks(MIXED_LONG + MIXED_TOKENS + 1),
        )
        self.engine = Engine.from_dir(
            model_dir,
            # every batch of prompts fits one step: a prefill is one batched forward, as in transformers
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max(prefill_batch * PREFILL_LEN, decode_batch * DECODE_PROMPT),
                max_num_seqs=max(prefill_batch, decode_batch),
            ),
            max_model_len=max(PREFILL_LEN + DECODE_TOKENS, MIXED_LONG + MIXED_TOKENS) + 1,
            num_kv_blocks=blocks,  # enough that nothing is ever preempted
            block_size=BLOCK_SIZE,
            prepack_weights=prepack,
            cpu_expert_kernel=cpu_kernel,
            cpu_attention_kernel=cpu_attention,
            dtype="float32" if weights == "int8" else weights,
            quantization="int8" if weights == "int8" else None,
            # every run repeats its warm-up's prompts: with the prefix cache a timed prefill would compute only
            # the last block (measured: 31 ms instead of 171 for one 512-token prompt) and transformers caches none
            enable_prefix_caching=False,
        )
        self.weights = weights
        if cpu_kernel and kernel_isa is not None:
            build = cpu_moe.load_build(kernel_isa)
            if build is None:
                sys.exit(f"this CPU cannot run the {kernel_isa} build of the expert kernel")
            print(f"{kernel_isa} expert kernel: {use_cpu_expert_kernel(self.engine.model, (build,))}")
        self._ids = itertools.count()

    def _add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"bench-{next(self._ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(rid, prompt, params)
        return ids

    def prefill(self, prompts: list[list[int]]) -> float:
        self._add(prompts, max_tokens=1)
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) != len(prompts) or self.engine.has_unfinished():
            raise RuntimeError("the prefill batch did not run as one step; raise max_num_batched_tokens")
        return elapsed

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[list[int]]]:
        """→ (duration of each decode step, generated tokens per prompt including the first)."""
        ids = self._add(prompts, max_tokens=1 + new_tokens)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        steps: list[float] = []
        while self.engine.has_unfinished():
            started = all(tokens.values())  # from here on, each step is pure decode
            t0 = time.perf_counter()
            for out in self.engine.step():
                tokens[out.request_id] += out.new_token_ids
            if started:
                steps.append(time.perf_counter() - t0)
        return steps, [tokens[rid] for rid in ids]


class _StepClock(LogitsProcessor):
    """Stamps the time whenever generate() has new logits, i.e. once per model step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


class TransformersRunner:
    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None  # the equivalent of ignore_eos

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[list[int]]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding, the mask is all ones
        clock = _StepClock()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1 + new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
        steps = [b - a for a, b in itertools.pairwise(clock.stamps)]
        return steps, out[:, ids.shape[1] :].tolist()


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list]:
    """Run each system `repeats` times, one after the other, the order rotated and reversed each round so none
    is always first or last; → each system's results, in repeat order."""
    names = list(fns)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[:: 1 if r % 2 == 0 else -1]:
            out[name].append(fns[name]())
    return out


def _ratios(row: dict, pd_names: list[str]) -> None:
    """Each pdserve system's throughput over transformers'; `ratio` is the first one's (the headline)."""
    for name in pd_names:
        row[f"{name}_ratio"] = row[f"{name}_tok_s"] / row["transformers_tok_s"]
    row["ratio"] = row[f"{pd_names[0]}_ratio"]


def bench_prefill(systems: dict, batch: int, repeats: int, gen: torch.Generator) -> dict:
    """systems: name → PdserveRunner or TransformersRunner ("transformers")."""
    prompts = random_prompts(gen, batch, PREFILL_LEN, vocab_of(systems))
    for runner in systems.values():  # warm-up
        runner.prefill(prompts)
    times = interleaved({n: (lambda r=r: r.prefill(prompts)) for n, r in systems.items()}, repeats)
    row: dict = dict(batch=batch)
    for name, ts in times.items():
        row[f"{name}_tok_s"] = batch * PREFILL_LEN / statistics.median(ts)
        row[f"{name}_s"] = ts
    _ratios(row, pd_names(systems))
    return row


def bench_decode(systems: dict, batch: int, repeats: int, gen: torch.Generator, tokens: int = DECODE_TOKENS) -> dict:
    prompts = random_prompts(gen, batch, DECODE_PROMPT, vocab_of(systems))
    # A short warm-up suffices: kernels and allocations are per shape, not per step count.
    for runner in systems.values():
        runner.decode(prompts, 4)
    fns: dict[str, Callable[[], Any]] = {n: (lambda r=r: r.decode(prompts, tokens)) for n, r in systems.items()}
    # The host's rates, sampled in the same rounds as the runs: on a shared host the read bandwidth moved from
    # 30 to 47 GB/s between runs minutes apart, so a floor from one reading at another moment says little.
    fns[RATES] = lambda: (read_bandwidth(repeats=5), matmul_gflops(repeats=3))
    runs = interleaved(fns, repeats)
    rates = runs.pop(RATES)
    row: dict = dict(batch=batch, avg_context=DECODE_PROMPT + (tokens + 1) / 2)
    row |= dict(read_gbps_samples=[g for g, _ in rates], matmul_gflops_samples=[f for _, f in rates])
    row |= dict(read_gbps=statistics.median(row["read_gbps_samples"]))
    row |= dict(matmul_gflops=statistics.median(row["matmul_gflops_samples"]))
    for name, system_runs in runs.items():
        totals = [sum(steps) for steps, _ in system_runs]
        if any(len(steps) != tokens for steps, _ in system_runs):
            raise RuntimeError(f"{name}: expected {tokens} decode steps")
        row[f"{name}_tok_s"] = batch * tokens / statistics.median(totals)
        row[f"{name}_step_ms"] = 1000 * statistics.median(s for steps, _ in system_runs for s in steps)
        row[f"{name}_s"] = totals
    _ratios(row, pd_names(systems))
    # Same weights, greedy: the systems should write the same tokens (a check that the comparison is fair).
    hf_out = runs["transformers"][-1][1]
    for name in pd_names(systems):
        same = sum(a == b for a, b in zip(runs[name][-1][1], hf_out, strict=True))
        row[f"{name}_same_tokens"] = same / batch
    row["same_tokens"] = min(row[f"{n}_same_tokens"] for n in pd_names(systems))
    return row


def pd_names(systems: dict) -> list[str]:
    return [n for n in systems if n != "transformers"]


def vocab_of(systems: dict) -> int:
    return systems[pd_names(systems)[0]].engine.model.config.vocab_size


def bench_mixed_decode(pds: dict[str, PdserveRunner], repeats: int, gen: torch.Generator) -> list[dict]:
    """Decode steps of 31 short + 1 long sequence against 32 short ones, per pdserve system; every (system,
    case) run alternated within a repeat, the order reversed every other repeat. → one row per system."""
    vocab = next(iter(pds.values())).engine.model.config.vocab_size
    uniform = random_prompts(gen, MIXED_BATCH, MIXED_SHORT, vocab)
    mixed = uniform[:-1] + random_prompts(gen, 1, MIXED_LONG, vocab)
    for pd in pds.values():  # warm-up
        pd.decode(uniform, 4)
        pd.decode(mixed, 4)
    runs = {(s, case): [] for s in pds for case in ("uniform", "mixed")}
    for r in range(repeats):
        for system, case in list(runs)[:: 1 if r % 2 == 0 else -1]:
            steps, _ = pds[system].decode(uniform if case == "uniform" else mixed, MIXED_TOKENS)
            if len(steps) != MIXED_TOKENS:
                raise RuntimeError(f"{system} {case}: expected {MIXED_TOKENS} decode steps")
            runs[system, case] += steps
    rows = []
    for s in pds:
        uniform_ms, mixed_ms = (1000 * statistics.median(runs[s, case]) for case in ("uniform", "mixed"))
        rows.append(dict(system=s, batch=MIXED_BATCH, short_context=MIXED_SHORT, long_context=MIXED_LONG,
                         steps=MIXED_TOKENS, uniform_step_ms=uniform_ms, mixed_step_ms=mixed_ms,
                         ratio=mixed_ms / uniform_ms, uniform_steps_s=runs[s, "uniform"],
                         mixed_steps_s=runs[s, "mixed"]))  # fmt: skip
    return rows


def random_prompts(gen: torch.Generator, batch: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def decode_step_cost(
    model: torch.nn.Module, batch: int, context: float, weights: str | None = None
) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` sequences at average context `context`, its weights in
    format `weights` (--dtype; None: the model's dtype; int8: one byte a weight and float32 KV, scales ignored).

    A step reads every weight once (attention, norms, router, lm_head), except: of the experts only the
    distinct ones its tokens chose, about E * (1 - (1 - k/E)^B) per sparse layer if routing is uniform;
    of the embedding table one row per token (unless it doubles as the lm_head); plus the whole KV context.
    """
    cfg = model.config
    itemsize = next(model.parameters()).element_size()
    weight_size = {"int8": 1, "bfloat16": 2, "float32": 4, "float16": 2}.get(weights or "", itemsize)
    kv_size = 4 if weights == "int8" else weight_size
    expert_params = dense_params = 0
    for name, p in model.named_parameters():
        if ".experts." in name:  # the stacked routed experts; a shared expert counts as dense
            expert_params += p.numel()
        elif "embed_tokens" not in name or cfg.tie_word_embeddings:
            dense_params += p.numel()
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts_read = e * (1 - (1 - k / e) ** batch) if cfg.is_moe else 0.0
    per_expert = expert_params / e if cfg.is_moe else 0.0
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    read = (dense_params + per_expert * experts_read) * weight_size
    read += (batch * cfg.hidden_size + batch * context * kv_per_token) * kv_size
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # QK^T and PV, per token
    return read, batch * (2 * (dense_params + per_expert * k) + attention_flops)


def add_floor(rows: list[dict], model: torch.nn.Module, names: list[str]) -> None:
    """Each decode row's floors from the rates sampled in its own rounds (bench_decode); the row's floor is the
    first system's weight format's, and each system's `x_mem_floor` is over its own format's floor."""
    for row in rows:
        read, flops = decode_step_cost(model, row["batch"], row["avg_context"], weights_of(names[0]))
        gbps, gflops = row["read_gbps"], row["matmul_gflops"]
        row |= dict(step_mb=read / 1e6, mem_floor_ms=read / gbps / 1e6, compute_floor_ms=flops / gflops / 1e6)
        for name in names:
            own, _ = decode_step_cost(model, row["batch"], row["avg_context"], weights_of(name))
            row[f"{name}_mem_floor_ms"] = own / gbps / 1e6
            row[f"{name}_x_mem_floor"] = row[f"{name}_step_ms"] / row[f"{name}_mem_floor_ms"]


def print_report(
    cfg: dict, names: list[str], prefill: list[dict], decode: list[dict], mixed: list[dict] | None
) -> None:
    """names: the systems, pdserve ones first, transformers last."""
    pds = names[:-1]
    print(
        f"\npdserve vs transformers {cfg['transformers']} | torch {cfg['torch']} | {cfg['dtype']} | "
        f"{cfg['model_type']} {cfg['params'] / 1e6:.1f}M params, {cfg['num_experts']} experts "
        f"top-{cfg['num_experts_per_tok']}\n{describe(cfg)}; expert kernel builds here: "
        f"{', '.join(cfg['cpu_kernel_builds']) or 'none'}\n"
        f"read bandwidth {cfg['read_gbps']:.1f} GB/s, matmul {cfg['matmul_gflops']:.0f} GFLOP/s (after the decode "
        f"runs; each decode row's floors use the rates sampled in its own rounds), load average "
        f"{cfg['load_before'][0]:.1f} before, {cfg['load_after'][0]:.1f} after\n"
    )
    head = "".join(f"{n + ' tok/s':>26}" for n in names) + "".join(f"{n + ' / hf':>24}" for n in pds)
    print(f"{'phase':<8}{'batch':>6}{head}")
    for phase, rows in (("prefill", prefill), ("decode", decode)):
        for r in rows:
            cells = "".join(f"{r[f'{n}_tok_s']:>26.1f}" for n in names)
            print(f"{phase:<8}{r['batch']:>6}{cells}" + "".join(f"{r[f'{n}_ratio']:>24.2f}" for n in pds))
    print(f"\ndecode step vs floor (avg context {decode[0]['avg_context']:.1f} tokens): step ms (x mem floor)")
    head = "".join(f"{n:>26}" for n in names)
    # each pdserve system's share of sequences writing transformers' tokens, in the order of `pds`: another weights
    # format than transformers' own dtype makes another model (a share below 100% there is no fault)
    same_head = "same tokens (" + ", ".join(pds) + ")"
    print(f"{'batch':>5}{'MB/step':>9}{'mem floor ms':>14}{'FLOP floor ms':>15}{head}{'GB/s in its rounds':>22}"
          f"  {same_head}")  # fmt: skip
    for r in decode:
        cells = "".join(f"{r[f'{n}_step_ms']:>18.2f} ({r[f'{n}_x_mem_floor']:>4.1f})" for n in names)
        samples = r["read_gbps_samples"]
        rates = f"{r['read_gbps']:.1f} ({min(samples):.0f}-{max(samples):.0f})"
        same = "/".join(f"{r[f'{n}_same_tokens']:.0%}" for n in pds)
        print(
            f"{r['batch']:>5}{r['step_mb']:>9.1f}{r['mem_floor_ms']:>14.2f}{r['compute_floor_ms']:>15.2f}"
            f"{cells}{rates:>22}  {same}"
        )
    if not mixed:
        return
    m = mixed[0]
    print(
        f"\nmixed decode: {m['batch'] - 1} x {m['short_context']} + 1 x {m['long_context']} "
        f"context vs {m['batch']} x {m['short_context']}, median of {m['steps']} steps x repeats"
    )
    print(f"{'system':<30}{'uniform step ms':>16}{'mixed step ms':>15}{'mixed / uniform':>17}")
    for m in mixed:
        print(f"{m['system']:<30}{m['uniform_step_ms']:>16.2f}{m['mixed_step_ms']:>15.2f}{m['ratio']:>17.2f}")


def run_config(model_dir: Path, model, hf_model, quick: bool, prefill_repeats: int, decode_repeats: int) -> dict:
    return (
        {f: getattr(model.config, f) for f in MODEL_FIELDS}
        | cpu_info()
        | dict(
            model_dir=str(model_dir),
            params=sum(p.numel() for p in model.parameters()),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            torch=torch.__version__,
            transformers=transformers.__version__,
            hf_attn_implementation=hf_model.config._attn_implementation,
            hf_experts_implementation=getattr(hf_model.config, "_experts_implementation", None),
            prefill_len=PREFILL_LEN,
            decode_prompt_len=DECODE_PROMPT,
            mixed_decode=dict(short=MIXED_SHORT, long=MIXED_LONG, batch=MIXED_BATCH, tokens=MIXED_TOKENS),
            block_size=BLOCK_SIZE,
            quick=quick,
            prefill_repeats=prefill_repeats,
            decode_repeats=decode_repeats,
        )
    )


PREPACK_SYSTEMS = {"on": ("pdserve",), "off": ("pdserve_noprepack",), "both": ("pdserve", "pdserve_noprepack")}
CPU_KERNEL_SUFFIX = "_cpukernel"  # a system name with this runs its experts on the CPU expert kernel
TORCH_ATTENTION_SUFFIX = "_torchattn"  # a system name ending so runs decode attention on the torch buckets


def system_names(prepack: str, cpu_kernel: str, isas: list[str], cpu_attention: str = "on") -> list[str]:
    """pdserve systems for --prepack, --cpu-kernel, --kernel-isa (the first ISA unnamed, each further one a
    suffix) and --cpu-attention; with `both`, the kernels' systems come first (the headline). Attention on the
    CPU kernel is the default, so its systems carry no suffix."""
    with_kernel = [n + CPU_KERNEL_SUFFIX for isa in isas[:1] or [""] for n in PREPACK_SYSTEMS[prepack]]
    with_kernel += [n + CPU_KERNEL_SUFFIX + "_" + isa for isa in isas[1:] for n in PREPACK_SYSTEMS[prepack]]
    torch_experts = list(PREPACK_SYSTEMS[prepack])
    names = {"on": with_kernel, "off": torch_experts, "both": with_kernel + torch_experts}[cpu_kernel]
    torch_attention = [n + TORCH_ATTENTION_SUFFIX for n in names]
    return {"on": names, "off": torch_attention, "both": names + torch_attention}[cpu_attention]


WEIGHTS_SEPARATOR = "@"  # <system>@<weights>: that system with --dtype's weight format


def with_weights(names: list[str], weights: list[str]) -> list[str]:
    """Each system once per weight format of --dtype (all of the first format's first), or as they are."""
    return [f"{n}{WEIGHTS_SEPARATOR}{w}" for w in weights for n in names] if weights else names


def weights_of(name: str) -> str | None:
    return name.partition(WEIGHTS_SEPARATOR)[2] or None


def _base(name: str) -> str:
    return name.partition(WEIGHTS_SEPARATOR)[0]


def _kernel_isa(name: str, isas: list[str]) -> str | None:
    """The expert kernel build a system name asks for: its suffix, else the first --kernel-isa (None: default)."""
    name = _base(name)
    if CPU_KERNEL_SUFFIX not in name:
        return None
    suffix = name.removesuffix(TORCH_ATTENTION_SUFFIX).split(CPU_KERNEL_SUFFIX, 1)[1].lstrip("_")
    return suffix or (isas[0] if isas else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small qwen3_moe demo, generated once)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_bench.json"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer batch sizes (about a minute)")
    ap.add_argument("--prepack", choices=list(PREPACK_SYSTEMS), default="on",
                    help="pdserve with oneDNN-packed weights (on), plain ones (off), or both side by side")  # fmt: skip
    ap.add_argument("--no-prepack", dest="prepack", action="store_const", const="off", help="= --prepack off")
    ap.add_argument("--cpu-kernel", choices=("on", "off", "both"), default="on",
                    help="experts on the CPU expert kernel (on), the torch path (off), or both")  # fmt: skip
    ap.add_argument("--kernel-isa", default="",
                    help="comma-separated expert kernel builds side by side (default: the widest here)")  # fmt: skip
    ap.add_argument("--cpu-attention", choices=("on", "off", "both"), default="on",
                    help="decode attention on the CPU kernel (on), the torch buckets (off), or both")  # fmt: skip
    ap.add_argument("--skip-prefill", action="store_true", help="leave out the prefill measurement")
    ap.add_argument("--decode-batches", help="comma-separated decode batch sizes (default 1,8,32; --quick 1,32)")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, help="repeats of every measurement (default 5 prefill, 3 decode)")
    ap.add_argument("--skip-mixed", action="store_true", help="leave out the mixed-length decode measurement")
    ap.add_argument("--dtype", default="",
                    help="comma-separated weight formats side by side: float32, bfloat16, float16, int8 (load-time "
                    "weight-only int8); default: the checkpoint's own dtype")  # fmt: skip
    args = ap.parse_args()
    weight_formats = [w for w in args.dtype.split(",") if w]
    if unknown := set(weight_formats) - {"float32", "bfloat16", "float16", "int8"}:
        ap.error(f"--dtype: unknown weight format(s) {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)  # one process: this holds for every system
    load_before = load_average()
    prefill_batches, decode_batches = ((1,), (1, 32)) if args.quick else ((1, 8), (1, 8, 32))
    prefill_repeats, decode_repeats = (1, 1) if args.quick else (5, 3)
    if args.decode_batches:
        decode_batches = tuple(int(b) for b in args.decode_batches.split(","))
    if args.repeats:
        prefill_repeats = decode_repeats = args.repeats

    isas = [isa for isa in args.kernel_isa.split(",") if isa]
    model_dir = prepare_model(args.model)
    if args.skip_prefill:
        prefill_batches = ()
    systems: dict = {
        name: PdserveRunner(
            model_dir,
            max(prefill_batches, default=1),
            max(decode_batches),
            prepack=not name.startswith("pdserve_noprepack"),
            cpu_kernel=CPU_KERNEL_SUFFIX in name,
            kernel_isa=_kernel_isa(name, isas),
            cpu_attention=not _base(name).endswith(TORCH_ATTENTION_SUFFIX),
            weights=weights_of(name),
        )
        for name in with_weights(system_names(args.prepack, args.cpu_kernel, isas, args.cpu_attention), weight_formats)
    }
    pd = next(iter(systems.values()))
    model = pd.engine.model
    systems["transformers"] = hf = TransformersRunner(model_dir, next(model.parameters()).dtype)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    prefill = [bench_prefill(systems, b, prefill_repeats, gen) for b in prefill_batches]
    decode = [bench_decode(systems, b, decode_repeats, gen, args.decode_tokens) for b in decode_batches]
    gbps, gflops = read_bandwidth(), matmul_gflops()
    # the first system, and with --cpu-attention both its twin on the other attention path
    twins = {n: r for n, r in systems.items() if n.removesuffix(TORCH_ATTENTION_SUFFIX) == next(iter(systems))}
    mixed = None if args.skip_mixed else bench_mixed_decode(twins, decode_repeats, gen)
    add_floor(decode, model, list(systems))

    cfg = run_config(model_dir, model, hf.model, args.quick, prefill_repeats, decode_repeats)
    cfg |= dict(cpu_kernel_builds=[k.isa for k in cpu_moe.kernels()], kernel_isas=isas, weights=weight_formats)
    cfg |= dict(read_gbps=gbps, matmul_gflops=gflops, bench_seconds=time.perf_counter() - t0, systems=list(systems),
                decode_tokens=args.decode_tokens, load_before=load_before, load_after=load_average())  # fmt: skip
    print_report(cfg, list(systems), prefill, decode, mixed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    report = dict(timestamp=stamp, config=cfg, prefill=prefill, decode=decode, mixed_decode=mixed)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
