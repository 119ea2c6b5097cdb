"""The serving plane's CPU on the workers' cores (services/planning/cpu_share.py): the slowdown arithmetic, the
model's use of it per deployment, and the fit of the plane's measured CPU (services/planning/plane.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.cli import main
from services.planning.cpu_share import MAX_STOLEN, plane_cores, step_slowdown
from services.planning.model import Deployment, PerformanceModel
from services.planning.plane import CpuSample, fit_cpu
from services.planning.profile_file import PlaneCosts, dump_profile
from services.planning.simulate import SimRequest
from tests.unit.test_planning_model import synthetic


def test_a_plane_that_fits_the_idle_cores_slows_nothing():
    assert step_slowdown(busy_cores=1, shared_cores=2, plane=0.5) == 1.0
    assert step_slowdown(busy_cores=2, shared_cores=2, plane=0.0) == 1.0


def test_each_busy_core_loses_its_share_of_what_the_idle_cores_cannot_take():
    # 0.2 cores over 2 busy cores: each loses 10%
    assert step_slowdown(busy_cores=2, shared_cores=2, plane=0.2) == pytest.approx(1 / 0.9)
    # a third core of the budget left idle takes 1 of the 1.2 cores the plane needs
    assert step_slowdown(busy_cores=2, shared_cores=3, plane=1.2) == pytest.approx(1 / 0.9)


def test_the_slowdown_is_capped():
    assert step_slowdown(busy_cores=4, shared_cores=4, plane=10.0) == pytest.approx(1 / (1 - MAX_STOLEN))
    assert step_slowdown(busy_cores=0.0, shared_cores=1, plane=0.1) == 1.0  # nothing ran
    assert step_slowdown(busy_cores=1.5, shared_cores=2, plane=0.7) == pytest.approx(1 / (1 - 0.2 / 1.5))


def test_plane_cores_follow_the_arrival_rate_and_the_outputs():
    reqs = [SimRequest(i * 0.5, 100, 50) for i in range(11)]  # 2 req/s, 50 tokens each
    assert plane_cores(reqs, per_request_s=0.01, per_token_s=0.001) == pytest.approx(2 * (0.01 + 50 * 0.001))
    assert plane_cores(reqs[:1], 0.01, 0.001) == 0.0
    assert plane_cores(reqs, 0.0, 0.0) == 0.0


def _cpu_profile(per_token_s: float, client_per_token_s: float = 0.0):
    plane = PlaneCosts(0.005, 0.003, cpu_s_per_token=per_token_s, client_cpu_s_per_token=client_per_token_s)
    return synthetic((1, 2), plane)


def test_workers_slow_under_a_shared_plane_unless_the_budget_leaves_it_a_core():
    reqs = [SimRequest(i * 0.25, 100, 40) for i in range(40)]  # 4 req/s × 40 tokens × 1 ms: 0.16 cores
    shared, separate = PerformanceModel(_cpu_profile(0.001)), PerformanceModel(_cpu_profile(0.001), "separate")
    assert shared.plane_cores(reqs) == pytest.approx(0.16, rel=0.01)

    def tpot(model, deployment, cores=None):
        outs = model.simulate(deployment, reqs, cores)
        return sum(o.tpot_s for o in outs) / len(outs)

    for deployment in (Deployment.colocated("2", 1), Deployment.colocated("1", 2)):
        assert tpot(shared, deployment) >= tpot(separate, deployment) / (1 - 0.08) * 0.999  # 8% of each core
    # a budget with an idle core of its own gives the plane room: a 1-core worker in a 2-core budget is untouched
    alone = Deployment.colocated("1", 1)
    assert tpot(shared, alone, 2) == pytest.approx(tpot(separate, alone, 2))


def test_a_lightly_loaded_deployment_leaves_the_plane_its_idle_time():
    # 0.5 req/s: the worker steps a fraction of the time; a plane of 0.16 cores fits in the rest
    reqs = [SimRequest(i * 2.0, 100, 40) for i in range(20)]
    per_token = 0.16 / (0.5 * 40)
    shared = PerformanceModel(_cpu_profile(per_token))
    separate = PerformanceModel(_cpu_profile(per_token), "separate")
    assert shared.plane_cores(reqs) == pytest.approx(0.16, rel=0.01)
    one = Deployment.colocated("1", 1)
    assert [o.tpot_s for o in shared.simulate(one, reqs)] == pytest.approx(
        [o.tpot_s for o in separate.simulate(one, reqs)]
    )


def test_the_client_counts_only_when_asked_and_a_gpu_profile_never_shares():
    profile = _cpu_profile(0.0, client_per_token_s=0.001)
    reqs = [SimRequest(i * 0.25, 100, 40) for i in range(40)]
    assert PerformanceModel(profile).plane_cores(reqs) == 0.0
    assert PerformanceModel(profile, client_cpu=True).plane_cores(reqs) == pytest.approx(0.16, rel=0.01)
    gpu = msgspec.structs.replace(profile, host=msgspec.structs.replace(profile.host, device="cuda"))
    assert not PerformanceModel(gpu, client_cpu=True).plane_shares
    with pytest.raises(ValueError, match="plane_cpu"):
        PerformanceModel(profile, "elsewhere")


def test_plan_reports_the_plane_and_separate_takes_it_off(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_bytes(dump_profile(_cpu_profile(0.002)))
    args = ["plan", "--profile", str(path), "--ttft-ms", "2000", "--tpot-ms", "40", "--rate", "4", "--isl", "100",
            "--osl", "40", "--cores", "2", "--requests", "200"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    shared = json.loads(capsys.readouterr().out)
    assert shared["plane_cores"] == pytest.approx(4 * 40 * 0.002, rel=0.2)  # Poisson arrivals, lengths ± 0
    assert main([*args, "--plane-cpu", "separate", "--json"]) == 0
    separate = json.loads(capsys.readouterr().out)
    assert separate["plane_cores"] is None

    def tpot(plan, name):
        return next(a["tpot_p50_s"] for a in plan["alternatives"] if a["name"] == name)

    assert tpot(shared, "1 mixed [2]") > tpot(separate, "1 mixed [2]")
    assert main(args) == 0
    assert f"serving plane: {shared['plane_cores']:.2f} cores" in capsys.readouterr().out


def test_fit_cpu_recovers_per_request_and_per_token_seconds():
    phases = [CpuSample(6, 96, 6 * 0.02 + 96 * 0.001, 0.0), CpuSample(4, 384, 4 * 0.02 + 384 * 0.001, 0.0),
              CpuSample(16, 1536, 16 * 0.02 + 1536 * 0.001, 0.0)]  # fmt: skip
    assert fit_cpu(phases, lambda c: c.plane_s) == pytest.approx((0.02, 0.001))
    assert fit_cpu(phases, lambda c: c.client_s) == (0.0, 0.0)
    assert fit_cpu([], lambda c: c.plane_s) == (0.0, 0.0)
    # noise that would make a term negative: the other alone, never below 0
    noisy = [CpuSample(6, 96, 0.2, 0.0), CpuSample(4, 384, 0.1, 0.0), CpuSample(16, 1536, 0.3, 0.0)]
    per_request, per_token = fit_cpu(noisy, lambda c: c.plane_s)
    assert per_request >= 0 and per_token >= 0 and (per_request == 0 or per_token == 0)
