"""`pdserve profile` on the tiny demo model writes a profile that `pdserve plan` reads: real engines, timed; a TP 2
configuration is a real worker group of two processes over gloo (slow tier)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from datetime import UTC, datetime, timedelta

import pytest
import torch

from services.cli import main
from services.planning.profile import QUICK
from services.planning.profile_file import load_profile

PLAN = ["--ttft-ms", "500", "--tpot-ms", "50", "--rate", "2", "--isl", "64", "--osl", "8", "--cores", "2"]


def test_profile_quick_writes_a_profile_plan_reads(model_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model_dir), "--configs", "1", "--quick", "--out", str(out)]) == 0
    profile = load_profile(out)
    config = json.loads((model_dir / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    assert profile.model.fingerprint == "sha256:" + hashlib.sha256(canonical).hexdigest()[:16]
    assert profile.model.model_type == "qwen3_moe" and profile.model.kv_bytes_per_token > 0
    assert profile.host.torch == str(torch.__version__) and profile.host.cpu
    assert datetime.now(UTC) - datetime.fromisoformat(profile.created) < timedelta(minutes=10)
    assert profile.engine.max_num_batched_tokens == 512 and profile.engine.max_num_seqs == 64  # a worker's defaults

    measured = profile.config("1")
    assert [p.tokens for p in measured.prefill] == list(QUICK.prompt_lens)
    assert all(p.seconds > 0 and p.steps == 1 for p in measured.prefill)  # each fits one 512-token step
    timed = QUICK.decode_steps
    want = {(b, c + 1 + 2 + timed // 2) for b in QUICK.batches for c in QUICK.contexts}  # mean context of timed steps
    assert {(p.batch, round(p.context)) for p in measured.decode} == want
    assert all(p.step_s > 0 for p in measured.decode)
    assert measured.kv_tokens > 0

    capsys.readouterr()
    assert main(["plan", "--profile", str(out), *PLAN, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"]["units"] <= 2 and plan["alternatives"]


@pytest.mark.slow
def test_profile_of_a_tp2_group_measures_it_and_leaves_no_rank_behind(model_dir, tmp_path):
    out = tmp_path / "profile.json"
    args = ["profile", "--model", str(model_dir), "--configs", "2:tp2", "--quick", "--out", str(out)]
    assert main([*args, "--prompt-lens", "64", "--batches", "1,4", "--contexts", "32"]) == 0
    measured = load_profile(out).config("2:tp2")
    assert measured.config.ranks == 2
    assert [p.tokens for p in measured.prefill] == [64]
    assert sorted(p.batch for p in measured.decode) == [1, 4]
    assert not multiprocessing.active_children()  # the follower rank was joined when the group closed


@pytest.mark.slow
def test_profile_measures_the_serving_plane_on_a_local_stack(model_dir, tmp_path):
    out = tmp_path / "profile.json"
    args = ["profile", "--model", str(model_dir), "--configs", "1", "--quick", "--serving-plane", "--out", str(out)]
    assert main(args) == 0
    plane = load_profile(out).plane
    assert plane.source.startswith("measured on a local stack") and "B=16" in plane.source
    assert plane.ttft_s > 0  # HTTP, the gateway and two NATS hops are never free
    assert plane.handoff_s >= 0
    assert [n for n, _ in plane.worker] == [1, 4, 16] and all(t >= 0 for _, t in plane.worker)
    # the gateway, NATS and Redis are real processes: serving the probes cost them CPU, per request or per token
    assert plane.cpu_s_per_request + plane.cpu_s_per_token > 0 and "CPU per phase" in plane.source
    assert plane.client_cpu_s_per_request + plane.client_cpu_s_per_token > 0  # the probes' client parsed SSE
