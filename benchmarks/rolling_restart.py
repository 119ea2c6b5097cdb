"""Requests served during a rolling restart of every worker, against the same time without one.

    .venv/bin/python benchmarks/rolling_restart.py [--prefill 1] [--decode 1] [--clients 3] [--max-tokens 48]
                                                   [--out benchmarks/results/rolling_restart.json]

It starts `pdserve up` as a user does (the real command in the background, its output in a run directory) and a
steady load: --clients closed-loop clients, each streaming one greedy request after another (three prompts in
turn). Then, after a warm-up:

  1. the rolling restart: SIGHUP to `pdserve up`, timed until it says the restart is done (T seconds);
  2. a warm-up of the replacements (their first steps are slower), then the same load for the same T seconds
     without a restart.

A window's requests served are those that completed (whole, `[DONE]`) within it. Every request of the run is
checked too: failed (anything but completed) and mismatched (completed with other text than the single-process
engine's greedy answer) must both be 0; the exit status is 1 otherwise. Written to --out (JSON): both counts, their
ratio, T, the supervisor's report of the restart and the CPU model. One run: the load shares the CPUs with the
stack, so the figures vary with what else the host runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.local.infra import free_port  # noqa: E402
from tests.chaos import SteadyLoad  # noqa: E402

PROMPTS = ["The quick brown fox", "héllo wörld, 世界", "Tell me a story about disaggregation"]
# the name tests.chaos's client asks for; every prompt computed by a prefill worker, so both roles carry load
SERVICE_ENV = {"PDSERVE_MODEL_NAME": "demo", "PDSERVE_PREFILL_PATH": "remote"}


def log(message: str) -> None:
    print(f"[rolling_restart] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def references(model: str, max_tokens: int) -> dict[str, str]:
    """The single-process engine's greedy answers: what every request must reproduce."""
    from shared.engine.engine import Engine
    from shared.engine.sampling import SamplingParams
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = Engine.from_dir(model, max_model_len=2048).generate([tok.encode(p) for p in PROMPTS], params)
    return {p: tok.decode(o) for p, o in zip(PROMPTS, outs, strict=True)}


class Up:
    """`pdserve up` in the background, its output in run_dir/up.txt."""

    def __init__(self, run_dir: Path, args: argparse.Namespace, model: str) -> None:
        self.port = free_port()
        self.out = run_dir / "up.txt"
        cmd = [sys.executable, "-m", "services.cli", "up", "--model", model, "--port", str(self.port),
               "--prefill", str(args.prefill), "--decode", str(args.decode), "--threads-per-worker", "1",
               "--log-dir", str(run_dir / "logs")]  # fmt: skip
        log(shlex.join(cmd))
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=os.environ | SERVICE_ENV)  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up: no {text!r} within {timeout_s:g} s:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def served_within(outcomes, start: float, end: float) -> int:
    return sum(start <= done <= end and o.verdict == "completed" for _, done, o in outcomes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--clients", type=int, default=3, help="closed-loop streaming clients")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--warmup-s", type=float, default=15.0, help="load before each window")
    p.add_argument("--model", help="checkpoint (default: the tiny qwen3_moe demo, written once)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rolling_restart.json"))
    args = p.parse_args(argv)

    from services.demo_model import ensure_demo_checkpoint

    model = args.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-tiny-qwen3_moe"))
    expected = references(model, args.max_tokens)
    run_dir = Path(tempfile.mkdtemp(prefix="rolling-restart-"))
    up = Up(run_dir, args, model)
    try:
        up.wait_for("pdserve is ready", 300)
        load = SteadyLoad(up.url, PROMPTS, args.max_tokens, args.clients)
        try:
            log(f"warm-up {args.warmup_s:g} s")
            time.sleep(args.warmup_s)
            if not load.completed_by(time.monotonic()):
                raise RuntimeError(f"no request completed in the warm-up: {load.outcomes[:1]}")
            began = time.monotonic()
            up.proc.send_signal(signal.SIGHUP)
            up.wait_for("rolling restart d", 600)  # done (or stopped: the report says which)
            ended = time.monotonic()
            restart_s = ended - began
            log(f"rolling restart took {restart_s:.1f} s; warm-up of the replacements {args.warmup_s:g} s")
            time.sleep(args.warmup_s)
            baseline_start = time.monotonic()
            time.sleep(restart_s)
            baseline_end = time.monotonic()
        finally:
            outcomes = load.stop()
    finally:
        up.stop()
    said = [line.removeprefix("pdserve up: ") for line in up.output().splitlines() if line.startswith("pdserve up: ")]
    report = [line for line in said if "rolling" in line or "replace" in line or "drains" in line]
    failed = [o for _, _, o in outcomes if o.verdict != "completed"]
    mismatched = [o for _, _, o in outcomes if o.verdict == "completed" and o.text != expected[o.prompt]]
    during = served_within(outcomes, began, ended)
    without = served_within(outcomes, baseline_start, baseline_end)
    result = {
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"model": os.path.basename(model)},
        "restart_s": round(restart_s, 1),
        "served_during_restart": during,
        "served_without_restart": without,
        "ratio": round(during / without, 3) if without else None,
        "requests": len(outcomes),
        "failed": len(failed),
        "mismatched": len(mismatched),
        "restart_done": any(re.match(r"rolling restart done", line) for line in report),
        "supervisor": report,
        "run_dir": str(run_dir),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "supervisor"}, indent=2, ensure_ascii=False))
    log(f"written to {args.out}")
    ok = not failed and not mismatched and result["restart_done"]
    if failed:
        log(f"failed requests: {[(o.status, o.error, o.exception) for o in failed[:3]]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
