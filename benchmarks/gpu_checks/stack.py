"""Check 4: a 1 prefill + 1 decode stack (services/local/stack.py, what `pdserve up` runs) with both workers
on the GPU(s) streams the same text for a greedy request as `pdserve generate` on the device.

Two GPUs: prefill on cuda:0, decode on cuda:1, KV over NCCL. One GPU: both workers on cuda:0, KV over gloo
(NCCL refuses two ranks on one GPU). --allow-cpu: both on CPU, gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from benchmarks.gpu_checks.common import CheckResult, Target, verdict
from services.demo_model import write_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import Stack, StackSpec

NAME = "stack"
PROMPT = "The GPU path, end to end:"
MAX_TOKENS = 32
READY_TIMEOUT_S = 120.0


def spec(target: Target, model: str) -> StackSpec:
    """The stack for this target: workers on the device(s), NCCL between two GPUs."""
    if target.cpu:
        return StackSpec(model=model, port=free_port(), threads_per_worker=1)
    role_args = {"prefill": ("--device", target.device(0)), "decode": ("--device", target.device(1))}
    backend = ("--transfer-backend", "nccl") if target.two_gpus else ()
    return StackSpec(model=model, port=free_port(), worker_args=backend, role_args=role_args)


def check(target: Target) -> CheckResult:
    model = str(write_demo_checkpoint(Path(target.work_dir) / "stack-tiny", size="tiny"))
    expected = _generate(model, None if target.cpu else target.device(0))
    stack_spec = spec(target, model)
    stack = Stack(stack_spec, log_dir=str(Path(target.work_dir) / "stack-logs"))
    try:
        stack.start(ready_timeout_s=READY_TIMEOUT_S)
        chunks = _stream(stack.url, Path(model).name)  # the served name: the checkpoint directory's
    except Exception as e:
        raise RuntimeError(f"{e}\n{stack.logs()[-2000:]}") from e
    finally:
        stack.stop()
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    numbers = dict(chunks=len(chunks), text_chars=len(text), expected_chars=len(expected["text"]),
                   generate_tokens=len(expected["token_ids"]))  # fmt: skip
    failures = [] if text == expected["text"] else [f"streamed {text!r}, pdserve generate wrote {expected['text']!r}"]
    roles = {role: " ".join(args) for role, args in stack_spec.role_args.items()} or "cpu"
    details = (f"{MAX_TOKENS} greedy tokens, workers: {roles}, KV over "
               f"{'nccl' if target.two_gpus else 'gloo'}")  # fmt: skip
    return verdict(NAME, failures, numbers, details)


def _generate(model: str, device: str | None) -> dict:
    """`pdserve generate --json` in a process of its own, on `device` (None: the default, CPU)."""
    cmd = [sys.executable, "-m", "services.cli", "generate", PROMPT, "--model", model, "--max-tokens",
           str(MAX_TOKENS), "--ignore-eos", "--json"] + (["--device", device] if device else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve generate failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _stream(url: str, model_name: str) -> list[dict]:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        raw = resp.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    if events[-1] != "[DONE]":
        raise RuntimeError(f"the stream did not end with [DONE]: {raw[-500:]}")
    return [json.loads(e) for e in events[:-1]]
