"""The deployment planner's model (services/planning): step costs from a profile, the simulation's arithmetic on
requests worked out by hand, the ranking, the workload readers, and `pdserve plan` on the recorded profile giving
the answer docs/planning.md documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.planning.costs import DecodeCost, PrefillCost
from services.planning.model import Deployment, PerformanceModel, Slos
from services.planning.profile_file import (
    FORMAT,
    ConfigProfile,
    DecodePoint,
    EngineLimits,
    Host,
    ModelFacts,
    PlaneCosts,
    PrefillPoint,
    Profile,
    TransferCosts,
    WorkerConfig,
    dump_profile,
    load_profile,
)
from services.planning.simulate import SimRequest
from services.planning.workload import Workload, from_bench_result, from_lengths

RECORDED = Path(__file__).parent.parent / "data" / "planning" / "profile_small_epyc.json"
# docs/planning.md, "Example": `pdserve plan` on the recorded profile (the small demo, 1- and 2-core workers)
EXAMPLE = ["--ttft-ms", "2000", "--tpot-ms", "20", "--rate", "4", "--isl", "256", "--osl", "128", "--range-ratio",
           "0.5", "--cores", "2"]  # fmt: skip

# A made-up configuration whose costs are easy to add up by hand: a prefill step costs 10 ms plus 1 ms per
# prompt token (1000 tokens/s); a decode step of one sequence 9 ms + 0.01 ms per token of context, of four
# sequences 12 ms + 0.04 ms per token; a pull 2 ms + 10 ns per byte of 1000 bytes per token; the plane 5 ms more
# to every first token and 3 ms to every hand-off.
PREFILL = (PrefillPoint(100, 0.11, 1), PrefillPoint(200, 0.21, 1), PrefillPoint(400, 0.41, 1))
DECODE = (DecodePoint(1, 100, 0.010), DecodePoint(1, 300, 0.012), DecodePoint(4, 100, 0.016),
          DecodePoint(4, 300, 0.024))  # fmt: skip


PLANE = PlaneCosts(0.005, 0.003)


def synthetic(configs: tuple[int, ...] = (1,), plane: PlaneCosts = PLANE) -> Profile:
    return Profile(
        format=FORMAT,
        created="2026-12-06T00:00:00+00:00",
        host=Host(cpu="test", cores=4, device="cpu", torch="test"),
        model=ModelFacts(
            path="/m", model_type="test", fingerprint="sha256:0", params=1, dtype="float32", kv_bytes_per_token=1000
        ),  # fmt: skip
        engine=EngineLimits(max_num_seqs=64, max_num_batched_tokens=512, block_size=16, max_model_len=4096),
        transfer=TransferCosts(overhead_s=0.002, s_per_byte=1e-8, bytes_per_token=1000),
        plane=plane,
        configs=tuple(ConfigProfile(WorkerConfig(u), PREFILL, DECODE, kv_tokens=100_000) for u in configs),
    )


def decode_steps(prompt: int, steps: int) -> float:
    """The made-up config's decode steps of one sequence after a prompt of `prompt` tokens."""
    return sum(0.009 + 1e-5 * (prompt + 1 + k) for k in range(steps))


# ---- costs ----------------------------------------------------------------------------------------------------


def test_prefill_cost_gives_back_what_was_measured_and_extends_the_last_slope():
    cost = PrefillCost.fit(PREFILL, budget=512)
    assert cost.step_s == pytest.approx(0.010)
    for p in PREFILL:
        assert cost.alone_s(p.tokens, 512) == pytest.approx(p.seconds)
    assert cost.chunk_s(100, 300) == pytest.approx(0.2)
    assert cost.alone_s(1000, 512) == pytest.approx(2 * 0.010 + 1.0)  # two chunks, two steps' overheads


def test_prefill_cost_of_noisy_points_never_decreases():
    noisy = (PrefillPoint(16, 0.011, 1), PrefillPoint(64, 0.009, 1), PrefillPoint(256, 0.08, 1))
    cost = PrefillCost.fit(noisy, budget=512)
    assert 0 <= cost.step_s <= 0.009
    works = [cost.tokens_work(n) for n in range(0, 300, 10)]
    assert works == sorted(works)


def test_decode_cost_interpolates_in_batch_and_context_and_extrapolates_past_the_largest_batch():
    cost = DecodeCost.fit(DECODE)
    assert cost.step_s(1, 200) == pytest.approx(0.011)
    assert cost.step_s(4, 200) == pytest.approx(0.020)
    assert cost.step_s(2, 200) == pytest.approx(0.011 + (0.020 - 0.011) / 3)
    assert cost.step_s(8, 200) == pytest.approx(0.020 + 4 * (0.020 - 0.011) / 3)


def test_worker_overhead_between_and_past_its_points():
    from services.planning.costs import WorkerOverhead

    w = WorkerOverhead.of([(16, 0.016), (1, 0.002), (4, 0.001)])  # sorted, made non-decreasing
    assert w.points == ((1, 0.002), (4, 0.002), (16, 0.016))
    assert w.at(0) == w.at(1) == 0.002
    assert w.at(10) == pytest.approx(0.009) and w.at(32) == pytest.approx(0.016 + 16 * 0.014 / 12)
    assert WorkerOverhead.of([]).at(8) == 0.0


def test_decode_cost_of_a_batch_measured_at_one_context_takes_the_others_slope_per_sequence():
    cost = DecodeCost.fit((*DECODE[:2], DecodePoint(8, 100, 0.030)))
    assert cost.step_s(8, 300) == pytest.approx(0.030 + 8 * 1e-5 * 200)


# ---- the simulation, by hand ----------------------------------------------------------------------------------


def one_request(deployment: Deployment, prompt: int = 200, output: int = 5):
    model = PerformanceModel(synthetic())
    return model.simulate(deployment, [SimRequest(0.0, prompt, output)])[0]


def test_one_request_disaggregated():
    out = one_request(Deployment.disaggregated("1", 1, "1", 1))
    assert out.ttft_s == pytest.approx(0.010 + 0.200 + 0.005)  # step, 200 tokens, the plane
    pull = 0.003 + 0.002 + 200 * 1000 * 1e-8  # plane hand-off, pull overhead, bytes
    assert out.finish_s == pytest.approx(0.21 + pull + decode_steps(200, 4))
    assert out.tpot_s == pytest.approx((pull + decode_steps(200, 4)) / 4)


def test_one_request_colocated_decodes_in_the_steps_after_its_prompt():
    out = one_request(Deployment.colocated("1", 1))
    assert out.ttft_s == pytest.approx(0.215)
    assert out.tpot_s == pytest.approx(decode_steps(200, 4) / 4)


def test_a_single_output_token_ends_at_its_prefill():
    out = one_request(Deployment.disaggregated("1", 1, "1", 1), output=1)
    assert out.finish_s == pytest.approx(0.21)
    assert out.tpot_s == 0.0


def test_prompts_that_fit_one_step_are_batched_and_a_long_one_is_chunked():
    model = PerformanceModel(synthetic())
    reqs = [SimRequest(0.0, 400, 1), SimRequest(0.1, 200, 1), SimRequest(0.1, 200, 1)]  # two wait for the first
    both = model.simulate(Deployment.colocated("1", 1), reqs)[1:]
    assert [o.ttft_s for o in both] == pytest.approx([0.41 + 0.010 + 0.400 - 0.1 + 0.005] * 2)
    long = model.simulate(Deployment.colocated("1", 1), [SimRequest(0.0, 1000, 1)])[0]
    assert long.ttft_s == pytest.approx(2 * 0.010 + 1.0 + 0.005)


def test_a_colocated_prompt_stalls_the_decode_beside_it_and_a_disaggregated_one_does_not():
    reqs = [SimRequest(0.0, 100, 40), SimRequest(0.15, 400, 2)]  # the long prompt arrives while the first decodes
    model = PerformanceModel(synthetic((1,)))
    colocated = model.simulate(Deployment.colocated("1", 1), reqs)
    disaggregated = model.simulate(Deployment.disaggregated("1", 1, "1", 1), reqs)
    alone = model.simulate(Deployment.colocated("1", 1), reqs[:1])[0]
    assert colocated[0].tpot_s > alone.tpot_s + 0.39 / 39  # the 400-token step (0.4 s) spread over 39 tokens
    assert disaggregated[0].tpot_s < alone.tpot_s * 1.1


def test_a_second_decode_worker_takes_the_next_request_in_turn():
    model = PerformanceModel(synthetic())
    reqs = [SimRequest(0.0, 100, 50), SimRequest(0.0, 100, 50)]  # prefilled one after the other (0.11 s each)
    one = model.simulate(Deployment.disaggregated("1", 1, "1", 1), reqs)
    two = model.simulate(Deployment.disaggregated("1", 1, "1", 2), reqs)
    pull = 0.003 + 0.002 + 100 * 1000 * 1e-8
    alone = (pull + decode_steps(100, 49)) / 49
    # the first request's pull asks at 0.115, while the prefill worker computes the second prompt (0.11-0.22): its
    # blocks are exported when that step ends
    waited = (0.22 - 0.11 + 100 * 1000 * 1e-8 + decode_steps(100, 49)) / 49
    assert [o.tpot_s for o in two] == pytest.approx([waited, alone])  # each decode worker decodes one
    assert one[0].tpot_s > waited and one[1].tpot_s > alone  # batched together for most of their steps


def test_the_simulation_is_deterministic_and_more_workers_never_serve_worse():
    model = PerformanceModel(synthetic((1, 2)))
    wl = from_lengths(6.0, 300, 20, 0.5)
    reqs = wl.requests(400, seed=3)
    slos = Slos(ttft_s=0.8, tpot_s=0.05)
    small = model.predict(Deployment.disaggregated("1", 1, "1", 1), reqs, slos)
    assert model.predict(Deployment.disaggregated("1", 1, "1", 1), reqs, slos) == small
    big = model.predict(Deployment.disaggregated("1", 4, "1", 1), reqs, slos)
    assert small.attainment < 0.5 < 0.9 < big.attainment  # 6 x 0.3 s of prompts a second: one prefill worker drowns
    assert big.goodput > small.goodput


# ---- plans ----------------------------------------------------------------------------------------------------


def test_deployments_within_a_budget():
    model = PerformanceModel(synthetic((1, 2)))
    names = {d.name for d in model.deployments(3)}
    assert "1 prefill [1] + 2 decode [1]" in names and "1 prefill [2] + 1 decode [1]" in names
    assert "1 mixed [2]" in names and "3 mixed [1]" in names
    assert all(d.units(model.unit_of) <= 3 for d in model.deployments(3))
    assert not any(d.units(model.unit_of) > 3 for d in model.deployments(3))
    assert len(list(model.deployments(1))) == 1  # one mixed worker of one core


def test_a_light_load_is_served_by_the_fewest_units_and_a_heavy_one_by_more():
    model = PerformanceModel(synthetic((1,)))
    slos = Slos(ttft_s=1.0, tpot_s=0.05)
    light = model.plan(from_lengths(0.2, 200, 10), slos, budget=4, requests=200, with_max_rate=False)
    assert light.recommended.deployment == Deployment.colocated("1", 1)
    heavy = model.plan(from_lengths(8.0, 300, 10, 0.3), slos, budget=4, requests=400, with_max_rate=False)
    assert heavy.recommended.units == 4
    assert heavy.recommended.goodput == max(p.goodput for p in heavy.alternatives)
    assert heavy.fewest_units is None or heavy.fewest_units.attainment >= 0.9


def test_max_rate_is_where_attainment_crosses_the_target():
    model = PerformanceModel(synthetic((1,)))
    wl, slos = from_lengths(1.0, 200, 10), Slos(ttft_s=1.0, tpot_s=0.05)
    d = Deployment.colocated("1", 1)
    rate = model.max_rate(d, wl, slos, target=0.9)
    assert 1.0 < rate < 1 / 0.21  # below the prompts' own throughput (one 200-token prompt per 0.21 s)
    below = model.predict(d, wl.with_rate(rate * 0.9).requests(500), slos).attainment
    above = model.predict(d, wl.with_rate(rate * 1.3).requests(500), slos).attainment
    assert below >= 0.9 > above


def test_a_deployment_needs_both_roles_or_mixed_alone():
    with pytest.raises(ValueError):
        Deployment(prefill=("1", 1))
    with pytest.raises(ValueError):
        Deployment(prefill=("1", 1), decode=("1", 1), mixed=("1", 1))
    with pytest.raises(ValueError):
        Deployment.colocated("1", 0)


# ---- workloads and files --------------------------------------------------------------------------------------


def test_workload_from_lengths_and_its_percentiles():
    wl = from_lengths(2.0, 100, 20, range_ratio=0.5)
    assert min(wl.prompt_lens) == 50 and max(wl.prompt_lens) == 150
    reqs = wl.requests(300, seed=1)
    assert reqs == wl.requests(300, seed=1)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert 120 < reqs[-1].arrival_s < 180  # 300 Poisson arrivals at 2/s
    s = wl.summary()
    assert s["isl"]["p50"] == pytest.approx(100) and s["isl"]["p90"] == pytest.approx(140)


def test_workload_from_a_detailed_bench_result(tmp_path):
    doc = {"request_rate": 4.0, "burstiness": 1.0, "input_lens": [10, 1000, 20, 30], "output_lens": [5, 6, 7, 8],
           "start_times": [0.0, 1.0, 2.0, 3.0], "errors": ["", "", "boom", ""]}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    wl = from_bench_result(path)
    assert wl.paired and wl.rate == pytest.approx(1.0)  # 3 gaps over 3 s of sends
    assert sorted(zip(wl.prompt_lens, wl.output_lens, strict=True)) == [(10, 5), (30, 8), (1000, 6)]
    assert {(r.prompt_len, r.output_len) for r in wl.requests(50)} <= {(10, 5), (30, 8), (1000, 6)}
    assert from_bench_result(path, rate=3.0).rate == 3.0


def test_workload_from_a_plain_bench_result_and_one_it_cannot_read(tmp_path):
    plain = tmp_path / "plain.json"
    flags = {"random_input_len": 64, "random_output_len": 8, "random_range_ratio": 0.0}
    plain.write_text(json.dumps({"dataset_name": "random", "request_rate": 2.5, "burstiness": 1.0, "workload": flags}))
    wl = from_bench_result(plain)
    assert wl.rate == 2.5 and set(wl.prompt_lens) == {64} and set(wl.output_lens) == {8}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"dataset_name": "sharegpt", "request_rate": 1.0}))
    with pytest.raises(ValueError, match="save-detailed"):
        from_bench_result(other)
    with pytest.raises(ValueError, match="finite"):
        Workload(float("inf"), (1,), (1,))


def test_profile_file_round_trips_and_refuses_a_wrong_one(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(dump_profile(synthetic((1, 2))))
    assert load_profile(path) == synthetic((1, 2))
    doc = json.loads(path.read_text())
    doc["configs"][0]["prefill"][0]["tokens"] = "many"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="tokens"):
        load_profile(path)
    doc["format"] = "something/9"
    doc["configs"][0]["prefill"][0]["tokens"] = 100
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format"):
        load_profile(path)


def test_worker_config_specs():
    assert WorkerConfig.parse("2:tp2") == WorkerConfig(2, tp=2)
    assert WorkerConfig.parse("4:tp2:ep2").name == "4:tp2:ep2"
    for bad in ("0", "3:tp2", "2:tp2:ep4", "x"):
        with pytest.raises(ValueError):
            WorkerConfig.parse(bad)


# ---- `pdserve plan` on the recorded profile ------------------------------------------------------------------


def test_plan_on_the_recorded_profile_gives_the_documented_answer(capsys):
    assert main(["plan", "--profile", str(RECORDED), *EXAMPLE, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # docs/planning.md, "Example"
    assert plan["recommended"]["name"] == "1 prefill [1] + 1 decode [1]"
    assert plan["recommended"]["goodput"] == pytest.approx(3.80, abs=0.005)
    assert plan["recommended"]["attainment"] == pytest.approx(0.98, abs=0.005)
    assert plan["max_rate"] == pytest.approx(4.5, abs=0.05)
    assert plan["colocated_better"] is False
    ranked = [(a["name"], round(a["goodput"], 2)) for a in plan["alternatives"]]
    assert ranked == [("1 prefill [1] + 1 decode [1]", 3.80), ("2 mixed [1]", 2.85), ("1 mixed [2]", 2.78),
                      ("1 mixed [1]", 0.02)]  # fmt: skip


def test_plan_prints_the_recommendation_and_the_ranking(capsys):
    assert main(["plan", "--profile", str(RECORDED), *EXAMPLE]) == 0
    text = capsys.readouterr().out
    assert "recommended: 1 prefill [1] + 1 decode [1] (2 cores)" in text
    assert "its CPU is not in this profile" in text  # recorded before --serving-plane measured it
    assert "0.75x the best disaggregated" in text and "disaggregated does at least as well" in text
    assert text.count("mixed [") >= 3


def test_plan_refuses_a_workload_it_cannot_read(capsys, tmp_path):
    assert main(["plan", "--profile", str(RECORDED), "--ttft-ms", "100", "--tpot-ms", "10", "--rate", "1"]) == 2
    assert "--isl" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json"), *EXAMPLE]) == 2


def test_a_gpu_profile_is_planned_in_gpus(tmp_path, capsys):
    gpu = synthetic((1, 2))
    path = tmp_path / "gpu.json"
    doc = json.loads(dump_profile(gpu))
    doc["host"]["device"] = "cuda"
    path.write_text(json.dumps(doc))
    args = ["plan", "--profile", str(path), "--ttft-ms", "1000", "--tpot-ms", "50", "--rate", "1", "--isl", "100",
            "--osl", "10", "--requests", "100"]  # fmt: skip
    assert main([*args, "--gpus", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["unit"] == "gpus" and plan["budget"] == 2
    assert main([*args, "--cores", "2"]) == 2
    assert "give --gpus" in capsys.readouterr().err


def test_plane_costs_take_the_workers_time_outside_the_engine_per_batch_size():
    from services.bench.metrics import RequestRecord
    from services.planning.plane import BatchSample, PlaneSample, plane_costs, together

    profile = synthetic()
    cost = DecodeCost.fit(DECODE)
    alone = PrefillCost.fit(PREFILL, 512).alone_s(100, 512)
    worker = 0.001 + 0.0005  # per step + per token, one sequence
    pull = 0.002 + 100 * 1000 * 1e-8
    lone = [PlaneSample(100, alone + worker + 0.007, cost.step_s(1, 101) + worker + pull + 0.004,
                        tuple(cost.step_s(1, 102 + k) + worker for k in range(5)))] * 3  # fmt: skip
    batches = [BatchSample(b, cost.step_s(b, 150) + 0.001 + 0.0005 * b, 150) for b in (4, 16)]
    plane = plane_costs(profile, lone, batches)
    assert [n for n, _ in plane.worker] == [1, 4, 16]
    assert [t for _, t in plane.worker] == pytest.approx([0.0015, 0.003, 0.009])  # the gaps less the engine's steps
    assert plane.ttft_s == pytest.approx(0.007) and plane.handoff_s == pytest.approx(0.004)

    # two requests decoding together from 1.25 s to 2.0 s: only the gaps inside that window count
    a = RequestRecord("x", 10, 6, 0.0, True, ttft_s=1.0, itl_s=[0.25] * 5, latency_s=2.25)
    b = RequestRecord("x", 20, 4, 0.5, True, ttft_s=0.75, itl_s=[0.25] * 3, latency_s=1.5)
    got = together(2, [a, b])
    assert got is not None and got.batch == 2 and got.gap_s == pytest.approx(0.25)
    assert got.context == pytest.approx((12 + 13 + 14 + 21 + 22 + 23) / 6)  # prompt + tokens so far, per gap
