"""`make gpu-check`: prove the GPU path on a CUDA machine in one command; prints one JSON object.

    .venv/bin/python benchmarks/gpu_check.py [--out FILE] [--allow-cpu] [--only NAME ...]

Checks (benchmarks/gpu_checks/, one module each, each in a child process under its own timeout):
  parity     every architecture against transformers on the device: float32 token-exact, bfloat16 in bounds
  kernels    each Triton kernel against its torch reference on realistic shapes, and its speed against the
             torch path the model runs today
  kv_pull    a KV pull between two processes over the transfer plane (NCCL with two GPUs), bytes identical,
             GB/s against a raw send/recv of the same bytes
  stack      a 1 prefill + 1 decode stack on the GPU(s) streams the same text as `pdserve generate`
  throughput decode tokens/s of the small demo model at 32 sequences in bfloat16, ours and transformers
  graphs     decode CUDA graphs against the eager path: tokens identical, step ms at 1/8/32 sequences, speedup
Exit status: 0 every check ok; 1 a check failed; 3 no CUDA (unless --allow-cpu: then every check runs on CPU
with gloo, the Triton kernels interpreted (TRITON_INTERPRET=1), tiny shapes and fewer steps, which proves this
script's own logic, not the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

import torch  # noqa: E402
import torch.cuda.nccl  # noqa: E402  (NCCL's version, recorded on a GPU)

from benchmarks.gpu_checks.common import CheckResult, Target, run_isolated  # noqa: E402

NO_CUDA = 3
# name → timeout in seconds on a GPU (they sum to under 8 minutes); the check is benchmarks.gpu_checks.<name>.
# Modules are imported only in the check's own process: triton must not be imported before TRITON_INTERPRET is set.
# stack gave 30 s of its 150 to graphs (a one-model check) so that the sum stays under 8 minutes.
CHECKS = {"parity": 90, "kernels": 60, "kv_pull": 60, "stack": 120, "throughput": 90, "graphs": 55}
CPU_TIMEOUT_S = 240  # the interpreter and a loaded CPU are slow; the rehearsal's shapes are tiny


def environment(target: Target) -> dict:
    """Device name and versions, recorded with the results."""
    import transformers
    import triton

    env = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
               python=platform.python_version(), cuda=torch.version.cuda, cpu_count=os.cpu_count())  # fmt: skip
    if target.cpu:
        return env | dict(mode="cpu (--allow-cpu: not a GPU result)", device=platform.processor() or "cpu")
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    names = [torch.cuda.get_device_name(i) for i in range(target.num_gpus)]
    return env | dict(mode="cuda", device=names[0], devices=names, nccl=".".join(map(str, nccl or ())) or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"))
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run every check on CPU")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run these checks only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device here; nothing checked (--allow-cpu rehearses the checks on CPU)",
              file=sys.stderr)  # fmt: skip
        return NO_CUDA
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: the check processes inherit it
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work_dir:
        target = Target(cpu=not cuda, num_gpus=torch.cuda.device_count() if cuda else 0, work_dir=work_dir)
        results: list[CheckResult] = []
        for name in args.only or CHECKS:
            timeout_s = CPU_TIMEOUT_S if target.cpu else CHECKS[name]
            results.append(run_isolated(name, f"benchmarks.gpu_checks.{name}", target, timeout_s))
            print(f"gpu_check: {name}: {results[-1].outcome} in {results[-1].wall_s:.1f} s", file=sys.stderr)
    report = dict(
        ok=all(r.ok for r in results),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        environment=environment(target),
        total_s=round(time.perf_counter() - started, 1),
        checks=[r.to_json() for r in results],
    )
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
