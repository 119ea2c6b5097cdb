"""`pdserve bench`: load any OpenAI-compatible endpoint and report TTFT, TPOT, ITL, E2EL, throughput and goodput,
with the flags and result keys of `vllm bench serve` where it has them.

services/cli.py registers it with add_bench_command(subparsers); `python -m services.bench.cli ...` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import httpx

from services.bench.client import api_root
from services.bench.datasets import BenchRequest, interference_requests, random_requests, sharegpt_requests
from services.bench.metrics import LATENCY_METRICS, SLO_KEYS, check_slos
from services.bench.prefix_workloads import (
    Conversation,
    multi_turn_conversations,
    prompt_share,
    shared_prefix_requests,
)
from services.bench.report import format_table
from services.bench.runner import BenchConfig, BenchResult, Workload, run

DATASETS = ("random", "sharegpt", "interference", "shared-prefix", "multi-turn")
MAX_ERRORS_SHOWN = 5


def add_bench_command(subparsers) -> argparse.ArgumentParser:
    """Register `pdserve bench` on an argparse subparsers object; the handler is bench_command."""
    p = subparsers.add_parser(
        "bench",
        help="load an OpenAI-compatible server and report TTFT/TPOT/ITL/E2EL, throughput and goodput",
        description=(__doc__ or "").split("\n\n")[0],  # None under python -OO
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    p.add_argument("--model", help="model name to request, or a checkpoint directory (then it is also the "
                   "tokenizer, and the name comes from GET /v1/models); default: the server's first model")  # fmt: skip
    p.add_argument("--served-model-name", help="model name to request when --model is a directory")
    p.add_argument("--tokenizer", metavar="DIR", help="checkpoint directory with tokenizer.json (default: --model "
                   "when it is a directory)")  # fmt: skip
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (prompt text) or /v1/chat/completions (one user message)")  # fmt: skip
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a connection or a chunk")
    p.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")

    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", help="the ShareGPT JSON file (sharegpt only)")
    data.add_argument("--num-prompts", type=int, default=1000,
                      help="requests to send (random, sharegpt, shared-prefix: spread over the groups)")  # fmt: skip
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len·(1−r), len·(1+r)], 0 ≤ r < 1")  # fmt: skip
    data.add_argument("--sharegpt-output-len", type=int, help="output length of every ShareGPT request "
                      "(default: the length of the conversation's reply)")  # fmt: skip
    data.add_argument("--duration", type=float, default=60.0, help="interference: seconds of stream arrivals")
    data.add_argument("--stream-rate", type=float, help="interference: stream requests/s (default --request-rate)")
    data.add_argument("--stream-input-len", type=int, default=128)
    data.add_argument("--stream-output-len", type=int, default=128)
    data.add_argument("--long-interval", type=float, default=10.0, help="interference: seconds between long prompts")
    data.add_argument("--long-input-len", type=int, default=1536)
    data.add_argument("--long-output-len", type=int, default=16)
    data.add_argument("--shared-prefix-groups", type=int, default=8, help="shared-prefix: distinct shared prefixes")
    data.add_argument("--shared-prefix-len", type=int, default=1024, help="shared-prefix: tokens of each prefix")
    data.add_argument("--shared-prefix-suffix-len", type=int, default=128,
                      help="shared-prefix: tokens after the prefix, each request its own")  # fmt: skip
    data.add_argument("--shared-prefix-output-len", type=int, default=128)
    data.add_argument("--multi-turn-conversations", type=int, default=32,
                      help="multi-turn: conversations, arriving at --request-rate")  # fmt: skip
    data.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: turns per conversation")
    data.add_argument("--multi-turn-input-len", type=int, default=128,
                      help="multi-turn: tokens of each turn's new user message")  # fmt: skip
    data.add_argument("--multi-turn-output-len", type=int, default=128)
    data.add_argument("--multi-turn-think-time", type=float, default=0.0,
                      help="multi-turn: seconds between an answer's end and the next turn")  # fmt: skip

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first, one at a time, not measured")
    load.add_argument("--seed", type=int, default=0)

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS", help=f"SLOs for goodput, keys {'|'.join(SLO_KEYS)}, "
                     "e.g. --goodput ttft:500 tpot:50")  # fmt: skip
    out.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS),
                     help="latency sections to print, comma-separated")  # fmt: skip
    out.add_argument("--metric-percentiles", default="50,90,99", help="percentiles to report, comma-separated")
    out.add_argument("--result-file", "--result-filename", dest="result_file", metavar="PATH",
                     help="write the result JSON here")  # fmt: skip
    out.add_argument("--kv-metrics-url", nargs="+", default=[], metavar="URL",
                     help="decode workers' /metrics URLs (`pdserve up` prints them): report the KV pulls' share of "
                     "TTFT, from pdserve:kv_transfer_seconds before and after the run")  # fmt: skip
    out.add_argument("--save-detailed", action="store_true", help="add per-request lists to the result JSON")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=bench_command)
    return p


def bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe. 0 on success, 1 when every request failed or the server cannot be
    asked for its model, 2 (with `pdserve: error: ...`) for bad arguments or dataset files."""
    try:
        return _bench(args)
    except (ValueError, OSError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"pdserve: error: {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace) -> int:
    goodput = parse_goodput(args.goodput or [])
    percentiles = parse_percentiles(args.metric_percentiles)
    sections = parse_metrics(args.percentile_metrics)
    model_is_dir = bool(args.model) and Path(args.model).is_dir()
    tokenizer_dir = args.tokenizer or (args.model if model_is_dir else None)
    if tokenizer_dir is None:
        raise ValueError("the workload needs a tokenizer: pass --tokenizer DIR (a checkpoint with tokenizer.json)")
    name = args.served_model_name or (None if model_is_dir else args.model)
    name = name or first_model(args.base_url, args.api_key, args.timeout)
    config = BenchConfig(
        base_url=args.base_url,
        model=name,
        endpoint=args.endpoint,
        # Interference requests all carry their send times; the rate recorded is that of the stream requests.
        request_rate=_stream_rate(args) if args.dataset_name == "interference" else args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        goodput_slos=goodput,
        percentiles=percentiles,
        seed=args.seed,
        api_key=args.api_key,
        timeout_s=args.timeout,
        progress=not args.disable_tqdm,
        extra_body=_extra_body(args.extra_body),
        kv_metrics_urls=tuple(args.kv_metrics_url),
    )
    requests = build_requests(args, _load_tokenizer(tokenizer_dir))
    print(_preamble(config, args, requests), flush=True)
    result = run(config, requests)
    sys.stdout.write(format_table(result.summary, percentiles, sections))
    if args.result_file:
        path = Path(args.result_file)
        workload = _workload(args, requests)
        doc = {"dataset_name": args.dataset_name, "workload": workload} | result.to_json(args.save_detailed)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {path}")
    return _report_failures(result)


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0}; ValueError on a bad pair, key or value."""
    slos: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--goodput takes KEY:MS pairs such as ttft:500, got {pair!r}")
    check_slos(slos)
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """ "50,90,99" → (50.0, 90.0, 99.0); ValueError unless each is a number within [0, 100]."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers such as 50,90,99, got {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be within [0, 100], got {text!r}")
    return values


def parse_metrics(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in LATENCY_METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics takes {','.join(LATENCY_METRICS)}, got {text!r}")
    return names


def _extra_body(value: object) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value


def first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The id of the first model GET /v1/models lists. Raises httpx.HTTPError when the server cannot be asked,
    ValueError when it lists none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{api_root(base_url)}/v1/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"{base_url} lists no model at /v1/models; pass --model NAME")
    return str(models[0]["id"])


def _load_tokenizer(model_dir: str):
    from shared.model.tokenizer import Tokenizer  # tokenizers and jinja2: only when a benchmark runs

    return Tokenizer(model_dir)


def build_requests(args: argparse.Namespace, tokenizer) -> Workload:
    """The workload the --dataset-* flags describe: requests, or conversations for multi-turn."""
    if args.dataset_path and args.dataset_name != "sharegpt":
        raise ValueError(f"--dataset-path is for --dataset-name sharegpt, not {args.dataset_name}")
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)  # fmt: skip
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.seed, args.sharegpt_output_len)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(
            tokenizer, args.shared_prefix_groups, args.num_prompts, args.shared_prefix_len,
            args.shared_prefix_suffix_len, args.shared_prefix_output_len, args.seed,
        )  # fmt: skip
    if args.dataset_name == "multi-turn":
        return multi_turn_conversations(tokenizer, args.multi_turn_conversations, args.multi_turn_turns,
                                        args.multi_turn_input_len, args.multi_turn_output_len,
                                        args.multi_turn_think_time, args.seed)  # fmt: skip
    return interference_requests(tokenizer, args.duration, _stream_rate(args), args.stream_input_len,
                                 args.stream_output_len, args.long_interval, args.long_input_len, args.long_output_len,
                                 args.seed, args.burstiness)  # fmt: skip


def _stream_rate(args: argparse.Namespace) -> float:
    rate = args.stream_rate if args.stream_rate is not None else args.request_rate
    if math.isinf(rate):
        raise ValueError("the interference workload needs a finite --stream-rate (or --request-rate)")
    return rate


def _workload(args: argparse.Namespace, requests: Workload) -> dict:
    """The dataset flags worth keeping beside the results, under their flag names (shared-prefix adds the
    prompt share its prefixes make up, as the tokenizer counted it)."""
    names = {
        "random": ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio"),
        "sharegpt": ("num_prompts", "dataset_path", "sharegpt_output_len"),
        "interference": ("duration", "stream_rate", "stream_input_len", "stream_output_len", "long_interval",
                         "long_input_len", "long_output_len"),
        "shared-prefix": ("num_prompts", "shared_prefix_groups", "shared_prefix_len", "shared_prefix_suffix_len",
                          "shared_prefix_output_len"),
        "multi-turn": ("multi_turn_conversations", "multi_turn_turns", "multi_turn_input_len",
                       "multi_turn_output_len", "multi_turn_think_time"),
    }[args.dataset_name]  # fmt: skip
    values = {name: getattr(args, name) for name in names}
    if args.dataset_name == "interference":
        values["stream_rate"] = _stream_rate(args)
    if args.dataset_name == "shared-prefix":
        values["prompt_share"] = prompt_share([r for r in requests if isinstance(r, BenchRequest)])
    return values


def _preamble(config: BenchConfig, args: argparse.Namespace, requests: Workload) -> str:
    kinds: dict[str, int] = {}
    for item in requests:
        for r in item.turns if isinstance(item, Conversation) else (item,):
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
    process = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
    counts = ", ".join(f"{n}" if k == "default" else f"{n} {k}" for k, n in kinds.items())
    lines = [
        f"Model: {config.model} at {api_root(config.base_url)} ({config.endpoint})",
        f"Workload: {args.dataset_name}, {counts} requests",
    ]
    if args.dataset_name == "shared-prefix":
        share = prompt_share([r for r in requests if isinstance(r, BenchRequest)]) or 0.0
        lines.append(f"Shared prefixes: {args.shared_prefix_groups} of {args.shared_prefix_len} tokens, "
                     f"{args.shared_prefix_suffix_len}-token suffixes: prompt share {share:.1%}")  # fmt: skip
    if args.dataset_name == "multi-turn":
        lines.append(f"Conversations: {len(requests)} of {args.multi_turn_turns} turns, think time "
                     f"{args.multi_turn_think_time:g} s; the request rate is conversations/s")  # fmt: skip
    if args.dataset_name == "interference":
        lines.append("Arrivals: fixed by the workload (--stream-rate, --long-interval)")
    else:
        lines.append(f"Traffic request rate: {config.request_rate}")
        lines.append(f"Burstiness factor: {config.burstiness} ({process})")
    lines.append(f"Maximum request concurrency: {config.max_concurrency}")
    return "\n".join(lines)


def _report_failures(result: BenchResult) -> int:
    failed = [r for r in result.records if not r.success]
    if failed:
        print(f"{len(failed)} of {len(result.records)} requests failed; the first errors:", file=sys.stderr)
        for r in failed[:MAX_ERRORS_SHOWN]:
            print(f"  {r.error}", file=sys.stderr)
    return 1 if len(failed) == len(result.records) else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.bench.cli ...`: the same command without the rest of pdserve."""
    parser = argparse.ArgumentParser(prog="pdserve")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
