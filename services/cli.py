"""`pdserve` command line: the services (up, gateway, prefill, decode, mixed), demo checkpoints,
single-process generation, and deployment planning (profile, plan)."""

from __future__ import annotations

import argparse
import errno
import json
import shlex
import sys
import time
from typing import TYPE_CHECKING

from services.bench.cli import add_bench_command
from services.experts_cli import add_experts_command
from services.planning.cli import add_planning_commands
from services.trace.timeline import add_trace_command
from shared.model.config import ARCHITECTURES
from shared.telemetry.lifecycle import EXIT_REFUSED  # argparse's own status: a bad flag exits with it too

if TYPE_CHECKING:
    from services.local.kv_certs import KvTlsFiles


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
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over generated tokens")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over generated tokens")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, over prompt and generated tokens")
    gen.add_argument("--min-p", type=float, default=0.0, help="[0, 1]")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    gen.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8_dequantized"],
        help="quantize the float weights at load: int8 = weight-only int8 on the CPU kernels (float32)",
    )
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    gen.add_argument("--device", default="cpu", help="torch device of the model and the KV cache: cpu, cuda, cuda:N")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (a worker group of processes)")
    gen.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (1 or the group size)")
    gen.add_argument(
        "--dp-attention",
        action="store_true",
        help="data-parallel attention over the --ep ranks (each rank its own requests; MoE models)",
    )
    gen.add_argument(
        "--n", type=int, default=1, help="choices: the prompt computed once, choice i seeded seed + i (default 1)"
    )
    gen.set_defaults(func=_generate)

    _add_service_commands(sub)
    add_trace_command(sub)
    add_bench_command(sub)
    add_experts_command(sub)
    add_planning_commands(sub)
    args = parser.parse_args(argv)  # a bad flag: argparse exits EXIT_REFUSED
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PermissionError) as exc:  # a setting, checkpoint or port refused
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def _demo_model(args: argparse.Namespace) -> int:
    from services.demo_model import write_demo_checkpoint

    out = write_demo_checkpoint(args.out_dir, args.arch, args.size, args.seed, args.dtype, args.max_shard_bytes)
    print(f"wrote a random-weight {args.size} {args.arch} checkpoint to {out} (its text is meaningless)")
    return 0


def _generate_engine(args: argparse.Namespace):
    """The engine of `generate` and the worker group it leads: one process (no group), or with --tp/--ep > 1 a
    worker group led by this process."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    config = EngineConfig(
        model=str(args.model),
        dtype=args.dtype,
        quantization=args.quantization,
        threads=args.threads,
        device=args.device,
        tp=args.tp,
        ep=args.ep,
        dp_attention=args.dp_attention,
    )
    if max(args.tp, args.ep) == 1:
        return Engine.build(config), None
    from shared.parallel.group_engine import start_group

    group = start_group(config)
    return group.engine, group


def _generate(args: argparse.Namespace) -> int:
    from shared.engine.sampling import SamplingParams
    from shared.model.tokenizer import Tokenizer

    if args.max_tokens < 1:  # the engine takes 0 (score a prompt only); this command prints what it generates
        raise ValueError(f"max_tokens (--max-tokens) must be at least 1, got {args.max_tokens}")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
    )
    tokenizer = Tokenizer(args.model)
    prompt_ids = (
        tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else tokenizer.encode(args.prompt)
    )
    engine, group = _generate_engine(args)
    try:
        return _generate_with(args, engine, tokenizer, prompt_ids, params)
    finally:
        if group is not None:  # a planned stop: the followers leave their loops
            group.close()


def _generate_with(args: argparse.Namespace, engine, tokenizer, prompt_ids: list[int], params) -> int:
    from shared.model.detokenizer import IncrementalDetokenizer

    if args.n != 1:
        return _generate_choices(args, engine, tokenizer, prompt_ids, params)
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
            if out.finish_reason is not None:  # set exactly when the request finished (out.finished)
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


def _generate_choices(args: argparse.Namespace, engine, tokenizer, prompt_ids: list[int], params) -> int:
    """`generate --n N`: N choices of one prompt (Engine.add_group), each printed once all have finished."""
    from shared.engine.fork import Choice, choice_params

    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    ids = [f"cli-{i}" for i in range(args.n)]
    engine.add_group(prompt_ids, [Choice(rid, choice_params(params, i)) for i, rid in enumerate(ids)])
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason.value
    elapsed = time.perf_counter() - start
    choices = [
        {"index": i, "token_ids": tokens[rid], "text": tokenizer.decode(tokens[rid]), "finish_reason": reasons.get(rid)}
        for i, rid in enumerate(ids)
    ]
    if args.json:
        body = {"prompt_token_ids": prompt_ids, "choices": choices, "prefill_tokens": engine.stats.prefill_tokens}
        print(json.dumps(body | {"total_s": round(elapsed, 4)}, ensure_ascii=False))
        return 0
    for c in choices:
        print(f"--- choice {c['index']} (finish_reason={c['finish_reason']})")
        print(c["text"])
    print(f"[{args.n} choices in {elapsed:.2f}s, prompt computed once]", file=sys.stderr)
    return 0


def _add_service_flags(p: argparse.ArgumentParser, settings_cls: type, skip: tuple[str, ...] = ()) -> None:
    """The settings' own flags (shared/settings.py declares them), and the log level."""
    from shared.config_fields import add_flags

    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_flags(p, settings_cls, skip)


def _add_service_commands(sub) -> None:
    from services.gateway import main as gateway
    from shared.settings import WorkerSettings

    gw = sub.add_parser("gateway", help="the OpenAI-compatible REST gateway")
    gateway.add_arguments(gw)
    gw.set_defaults(func=gateway.run)

    for role in ("prefill", "decode", "mixed"):
        w = sub.add_parser(role, help=f"a {role} worker")
        _add_service_flags(w, WorkerSettings, skip=("role",))  # the subcommand is the role
        w.set_defaults(func=_worker, role=role)

    from services.planner import main as planner

    pl = sub.add_parser("planner", help="the SLO planner: switches workers' roles and publishes wanted counts")
    planner.add_arguments(pl)
    pl.set_defaults(func=planner.run)

    up = sub.add_parser("up", help="start NATS, Redis, the gateway and workers locally")
    up.add_argument("--model", help="checkpoint directory (default: the tiny demo model, written if missing)")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--mixed", type=int, default=0, help="colocated workers instead of prefill + decode")
    up.add_argument("--nats-url", help="use this NATS (JetStream enabled) instead of starting one")
    up.add_argument("--redis-url", help="use this Redis instead of starting one")
    up.add_argument(
        "--ha",
        action="store_true",
        help="replicate the private servers: a 3-node nats-server cluster (JetStream streams at 3 replicas) and "
        "Redis with a replica under 3 Sentinels, each node restarted when it dies (docs/reliability.md)",
    )
    up.add_argument("--threads-per-worker", type=int, default=1)
    for role in ("prefill", "decode", "mixed"):  # settings are per process: a role's own, e.g. its KV budget
        up.add_argument(
            f"--{role}-args",
            default="",
            metavar="FLAGS",
            help=f"extra flags for every {role} worker, as one shell-quoted string after an = "
            f"(e.g. --{role}-args='--kv-cache-bytes 2147483648'); PDSERVE_* variables reach every worker",
        )
    for role in ("prefill", "decode", "mixed"):
        up.add_argument(
            f"--{role}-devices",
            metavar="LIST",
            help=f"devices of the {role} workers, comma-separated (cpu, cuda, cuda:N, or a GPU index N): worker i "
            f"gets the (i mod count)-th, so fewer devices than workers share them (e.g. --{role}-devices 0)",
        )
    for role in ("prefill", "decode", "mixed"):
        for degree, what in (("tp", "tensor"), ("ep", "expert")):
            up.add_argument(
                f"--{role}-{degree}",
                type=int,
                default=1,
                help=f"{what}-parallel ranks of each {role} worker (a worker group of that many processes)",
            )
    up.add_argument(
        "--kv-stream-layers",
        action="store_true",
        help="prefill workers stream each request's KV layer by layer during its last chunk (PDSERVE_KV_STREAM_LAYERS)",
    )
    up.add_argument(
        "--kv-tls",
        action="store_true",
        help="mutual TLS on the workers' KV transfer gRPC: a CA and a certificate for every prefill and decode "
        "worker are made with openssl in <log dir>/kv-tls (docs/security.md)",
    )
    for part, what in (("ca", "CA that signs the certificate"), ("cert", "certificate (serverAuth and clientAuth, "
                       "naming the hosts decode workers dial)"), ("key", "certificate's key")):  # fmt: skip
        up.add_argument(
            f"--kv-tls-{part}", metavar="FILE", help=f"--kv-tls with your own files: the {what} (all three)"
        )
    up.add_argument(
        "--planner",
        action="store_true",
        help="run the SLO planner beside the gateway: it switches workers between prefill and decode to keep the "
        "TTFT and TPOT SLOs and publishes the counts it wants (docs/planning.md)",
    )
    up.add_argument("--planner-port", type=int, default=0, help="the planner's /plan and /metrics (default: any free)")
    up.add_argument(
        "--planner-args",
        default="",
        metavar="FLAGS",
        help="extra flags for the planner, as one shell-quoted string after an = (e.g. --planner-args='--ttft-slo-ms "
        "1000 --interval-s 2'); `pdserve planner --help` lists them",
    )
    up.add_argument("--trace-file", help="every service appends its spans here (read with `pdserve trace`)")
    up.add_argument("--drain-timeout-s", type=float, help="on SIGTERM / Ctrl-C: how long services drain (default 60)")
    up.add_argument("--log-dir", help="each service's output in <dir>/<service>.log (default: this terminal)")
    up.add_argument(
        "--supervisor-metrics-port",
        type=int,
        default=0,
        help="port of the supervisor's /metrics (restart counts; default: any free one, printed)",
    )
    up.set_defaults(func=_up)


def _worker(args: argparse.Namespace) -> int:
    """A worker process. Exit status: EXIT_REFUSED (2) when it refuses its configuration — a flag or PDSERVE_*
    value (`from_args`), the checkpoint (the engine's build: missing, unreadable, refused), a port it cannot bind
    — raised to `main`, which says why; 1 when its engine failed or it crashed (logged); 0 after a drain."""
    import asyncio
    import logging
    import signal

    from shared.settings import WorkerSettings, from_args
    from shared.telemetry.lifecycle import EXIT_GRACE_S, exit_by, exit_now, observe
    from shared.worker.host import WorkerHost

    settings = from_args(WorkerSettings, args)  # the role: the subcommand's default (it may switch: host.py)
    observe(args.role, settings.worker_id, args.log_level, settings.trace_file)

    async def serve() -> int:
        host = WorkerHost(settings, _worker_class)  # loads the checkpoint
        loop = asyncio.get_running_loop()

        def stop() -> None:  # drains; and ends this process by the supervisor's bound, supervisor or not
            exit_by(settings.drain_timeout_s + EXIT_GRACE_S)
            host.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        try:
            await host.run()
        except Exception as exc:
            if _port_refused(exc):
                raise ValueError(f"the {args.role} worker cannot bind its port: {exc}") from exc
            # anything else is a crash, whatever its type: exit 1 (restarted), never main's refusal status
            logging.getLogger("pdserve.worker").critical("the %s worker crashed", args.role, exc_info=exc)
            return 1
        finally:
            group = host.group
            if group is not None:  # a planned stop: the followers leave their loops (no rank-death exit)
                group.close()
        return 0 if host.failure is None else 1  # 1: the engine failed (logged)

    return exit_now(asyncio.run(serve()))


def _port_refused(exc: BaseException) -> bool:
    """Whether a worker's start failed on a port it cannot bind: its /metrics (an OSError) or its KV transfer
    gRPC server (grpc's RuntimeError says so in words)."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("Failed to bind to address")


def _worker_class(role: str):
    """The Worker class of a role (the host builds one per role it serves)."""
    if role == "prefill":
        from services.prefill.worker import PrefillWorker

        return PrefillWorker
    if role == "decode":
        from services.decode.worker import DecodeWorker

        return DecodeWorker
    from services.mixed.worker import MixedWorker

    return MixedWorker


def _up(args: argparse.Namespace) -> int:
    from services.local.kv_certs import KvCertError
    from services.local.preflight import preflight
    from services.local.stack import Stack, StackSpec
    from services.local.supervisor import Supervisor
    from shared.settings import CommonSettings, from_env

    model = args.model
    if model is None:
        from services.demo_model import ensure_demo_checkpoint  # torch: only when it writes one

        model = str(ensure_demo_checkpoint("models/demo-tiny-qwen3_moe"))
    # every service drains this long on SIGTERM; the supervisor waits that (and a grace) before SIGKILL
    drain_env = {} if args.drain_timeout_s is None else {"PDSERVE_DRAIN_TIMEOUT_S": str(args.drain_timeout_s)}
    if args.kv_stream_layers:  # every worker reads it: prefill streams, decode needs nothing set
        drain_env["PDSERVE_KV_STREAM_LAYERS"] = "1"
    kv_tls = _kv_tls(args)
    spec = StackSpec(
        model=model,
        port=args.port,
        prefill=0 if args.mixed else args.prefill,
        decode=0 if args.mixed else args.decode,
        mixed=args.mixed,
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        threads_per_worker=args.threads_per_worker,
        role_args={
            role: tuple(shlex.split(flags))
            for role in ("prefill", "decode", "mixed")
            if (flags := getattr(args, f"{role}_args"))
        },
        devices={
            role: tuple(d for d in devices.split(",") if d.strip())
            for role in ("prefill", "decode", "mixed")
            if (devices := getattr(args, f"{role}_devices"))
        },
        parallel={
            role: (tp, ep)
            for role in ("prefill", "decode", "mixed")
            if max(tp := getattr(args, f"{role}_tp"), ep := getattr(args, f"{role}_ep")) > 1
        },
        trace_file=args.trace_file,
        env=drain_env,
        kv_tls=kv_tls,
        planner=args.planner,
        planner_port=args.planner_port,
        planner_args=tuple(shlex.split(args.planner_args)),
        ha=args.ha,
    )
    # what every service would refuse is said now, before anything starts (a refusal later stops the stack too)
    ports = [(args.supervisor_metrics_port, "--supervisor-metrics-port"), (args.planner_port, "--planner-port")]
    preflight(spec, _worker_settings, ports, parse_planner=_planner_settings)
    drain_s = from_env(CommonSettings, drain_timeout_s=args.drain_timeout_s).drain_timeout_s
    stack = Stack(spec, log_dir=args.log_dir, quiet=args.log_dir is not None)
    supervisor = Supervisor(stack, drain_s, metrics_port=args.supervisor_metrics_port, on_ready=_print_ready(args))
    try:
        return supervisor.run()
    except KvCertError as exc:  # openssl refused a step of --kv-tls's generation (at launch): nothing was started
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


class _RefusingParser(argparse.ArgumentParser):
    """A parser whose errors are raised (a ValueError), not printed with an exit: `up` checks flags it passes on."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message)


def _worker_settings(role: str, flags, environ):
    """A `role` worker's settings from `flags` and `environ`, as `pdserve <role>` would build them; a ValueError
    names a flag it would refuse (`up`'s preflight)."""
    from shared.settings import WorkerSettings, from_args

    parser = _RefusingParser(prog=f"pdserve {role}", add_help=False)
    _add_service_flags(parser, WorkerSettings, skip=("role",))
    try:
        args = parser.parse_args(list(flags))
        return from_args(WorkerSettings, argparse.Namespace(**vars(args), role=role), environ)
    except ValueError as exc:
        raise ValueError(f"the {role} workers' settings: {exc}") from exc


def _planner_settings(flags, environ):
    """The planner's settings from `flags` and `environ`, as `pdserve planner` would build them (`up`'s preflight)."""
    from services.planner.main import add_arguments
    from shared.settings import PlannerSettings, from_args

    parser = _RefusingParser(prog="pdserve planner", add_help=False)
    add_arguments(parser)
    try:
        return from_args(PlannerSettings, parser.parse_args(list(flags)), environ)
    except ValueError as exc:
        raise ValueError(f"the planner's settings (--planner-args): {exc}") from exc


def _kv_tls(args: argparse.Namespace) -> bool | KvTlsFiles:
    """What `up` does about KV transfer TLS: the user's three files, True (generate; openssl is checked now, so
    its absence is an error before anything starts), or False."""
    from services.local.kv_certs import KvTlsFiles, find_openssl

    given = KvTlsFiles.given(args.kv_tls_ca, args.kv_tls_cert, args.kv_tls_key)
    if given is not None:
        return given
    if args.kv_tls:
        find_openssl()
    return bool(args.kv_tls)


def _print_ready(args: argparse.Namespace):
    import os
    from pathlib import Path

    def announce(supervisor) -> None:
        stack = supervisor.stack
        name = Path(stack.spec.model).name
        print(f"\npdserve is ready at {stack.url}/v1  (model {name!r}; Ctrl-C or SIGTERM stops everything)")
        print(f"  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        print(f'    -d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}]}}\'')
        print(f"  metrics: {stack.url}/metrics (gateway), " + ", ".join(stack.metrics_urls()))
        print(f"  supervisor: {supervisor.metrics_url} (pdserve:supervisor_restarts_total per service)")
        if stack.planner_port is not None:
            print(f"  planner: http://{stack.spec.host}:{stack.planner_port}/plan (decisions), /metrics")
        print(f"  rolling restart of the workers: kill -HUP {os.getpid()}")
        if "PDSERVE_ADMIN_KEYS" in os.environ | stack.spec.env:  # the admin API is on (docs/api.md, "Admin API")
            print(f"  workers and their roles: {stack.url}/admin/workers (Authorization: Bearer <admin key>)")
        if args.log_dir:
            print(f"  logs: {stack.log_dir}/<service>.log")
        if args.trace_file:
            print(f"  spans: {args.trace_file} (pdserve trace {args.trace_file})")
        if stack.kv_tls is not None:
            print(f"  KV transfer: mutual TLS (CA {stack.kv_tls.ca}, certificate {stack.kv_tls.cert})")
        if stack.nats_cluster is not None:
            nodes = ", ".join(f"{name} {url}" for name, url in stack.nats_cluster.monitor_urls.items())
            print(f"  NATS cluster, monitoring: {nodes}")
        if stack.redis_sentinels is not None:
            nodes = ", ".join(f"{n.name} {n.host}:{n.port}" for n in stack.redis_sentinels.nodes)
            print(f"  Redis: {nodes}; Sentinels {stack.redis_sentinels.addresses} (primary: SENTINEL "
                  f"GET-MASTER-ADDR-BY-NAME {stack.redis_sentinels.master})")  # fmt: skip
        print(flush=True)

    return announce


if __name__ == "__main__":
    sys.exit(main())
