"""benchmarks/gpu_check.py (`make gpu-check`) rehearsed on CPU: the script's own logic, not the GPU.

`--allow-cpu` runs every check on CPU (gloo, Triton interpreted, tiny shapes); CUDA is hidden from the
script (CUDA_VISIBLE_DEVICES="") so this test means the same on a GPU machine. Also: the distinct exit status
without CUDA, the runner's handling of a check that raises or hangs, and StackSpec.role_args.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.gpu_checks.common import Outcome, Target, run_isolated
from services.local.stack import Stack, StackSpec

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CHECKS = ["parity", "kernels", "kv_pull", "stack", "throughput", "graphs"]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)  # fmt: skip


# Every check of the script rehearsed end to end (interpreted kernels, a stack, throughput runs): minutes on two
# cores, so the slow tier (make test-slow, which CI runs); the runner's own logic below stays in make test.
@pytest.mark.slow
def test_every_check_passes_on_cpu_and_the_report_has_its_shape(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--allow-cpu", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    assert report["ok"] is True
    assert report["environment"]["mode"].startswith("cpu") and report["environment"]["triton"]
    assert {"torch", "transformers", "device", "cuda"} <= set(report["environment"])
    assert [c["name"] for c in report["checks"]] == CHECKS
    for c in report["checks"]:
        assert set(c) == {"name", "ok", "outcome", "wall_s", "numbers", "details"}, c
        assert c["ok"] is True and c["outcome"] == "pass" and c["wall_s"] > 0 and c["details"], c
    checks = {c["name"]: c for c in report["checks"]}
    parity = checks["parity"]["numbers"]
    assert set(parity) == {"llama", "qwen3_moe"} and "subset" in checks["parity"]["details"]
    assert all(row["float32"]["tokens_equal"] == 1.0 for row in parity.values())
    kernels = checks["kernels"]["numbers"]
    assert len(kernels) == 4 and all(row["kernel_ms"] > 0 and row["torch_path_ms"] > 0 for row in kernels.values())
    kv = checks["kv_pull"]["numbers"]
    assert kv["backend"] == "gloo" and kv["identical"] == kv["pulls"] == 4 and kv["pull_gbps"] > 0
    assert checks["stack"]["numbers"]["text_chars"] == checks["stack"]["numbers"]["expected_chars"] > 0
    throughput = checks["throughput"]["numbers"]
    assert throughput["ours_tokens_per_s"] > 0 and throughput["transformers_tokens_per_s"] > 0
    graphs = checks["graphs"]["numbers"]
    assert graphs["tokens_equal"] == 1.0 and graphs["graph_steps"] > 0 and graphs["buckets"] == [1, 2, 4]
    assert all(graphs[f"{n}_seqs"]["eager_ms"] > 0 and graphs[f"{n}_seqs"]["graph_ms"] > 0 for n in (1, 2, 4))
    assert "EagerReplay" in checks["graphs"]["details"]


def test_the_checks_timeouts_sum_to_under_8_minutes():
    from benchmarks.gpu_check import CHECKS as TIMEOUTS

    assert list(TIMEOUTS) == CHECKS and sum(TIMEOUTS.values()) < 8 * 60


def test_without_cuda_it_exits_with_its_own_status_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--out", str(out), timeout=120)
    assert proc.returncode == 3
    assert "no CUDA" in proc.stderr and proc.stdout == ""
    assert not out.exists()


@pytest.fixture
def fake_checks(tmp_path, monkeypatch):
    """A module of checks that misbehave, importable by the runner's spawned child (it inherits sys.path)."""
    (tmp_path / "fake_gpu_checks.py").write_text(
        textwrap.dedent("""
        import time
        def check(target):
            if target.work_dir == "raise":
                raise ValueError("the check broke")
            time.sleep(600)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_gpu_checks"


def test_a_check_that_raises_or_hangs_fails_alone(fake_checks):
    broke = run_isolated("boom", fake_checks, Target(cpu=True, num_gpus=0, work_dir="raise"), timeout_s=60)
    assert broke.outcome is Outcome.FAIL and not broke.ok and "the check broke" in broke.details
    hung = run_isolated("hang", fake_checks, Target(cpu=True, num_gpus=0, work_dir="sleep"), timeout_s=5)
    assert hung.outcome is Outcome.FAIL and "timed out after 5 s" in hung.details
    assert 5 <= hung.wall_s < 30


def test_role_args_reach_only_that_roles_workers(tmp_path):
    spec = StackSpec(model="m", worker_args=("--x",), role_args={"decode": ("--device", "cuda:1")})
    stack = Stack(spec, log_dir=str(tmp_path))
    assert stack._worker_flags("decode")[-3:] == ["--x", "--device", "cuda:1"]
    assert "--device" not in stack._worker_flags("prefill")
    with pytest.raises(ValueError, match="role_args: unknown roles"):
        StackSpec(model="m", role_args={"gpu": ("--device", "cuda:0")})
