"""The expert placement planner (shared/sharding/placement.py) and `pdserve experts plan`."""

from __future__ import annotations

import json

import pytest

from services.cli import main
from shared.sharding.placement import (
    ExpertPlacement,
    PlacementError,
    imbalance,
    parse_stats,
    plan_placement,
    rank_loads,
)
from shared.telemetry import metrics

# Zipf-like skew over 16 experts, hottest first in layer 0, a different order in layer 1
SKEWED = {0: [int(10_000 / (i + 1) ** 1.2) for i in range(16)], 1: [int(10_000 / (i + 1)) for i in reversed(range(16))]}


def _check_placement(p: ExpertPlacement, num_experts: int, ep: int, redundant: int) -> None:
    for ranks in p.layers.values():
        assert len(ranks) == ep
        assert {len(slots) for slots in ranks} == {(num_experts + redundant) // ep}  # equal slot counts
        assert all(len(set(slots)) == len(slots) for slots in ranks)  # no rank holds an expert twice
        assert {e for slots in ranks for e in slots} == set(range(num_experts))  # every expert placed
        assert sum(len(slots) for slots in ranks) == num_experts + redundant


@pytest.mark.parametrize("ep", [2, 4])
def test_the_busiest_rank_gets_lighter_as_redundant_slots_grow(ep):
    for layer in SKEWED:
        peaks = []
        for redundant in range(0, 16 * (ep - 1) + 1, ep):
            p = plan_placement(SKEWED, ep, redundant)
            _check_placement(p, 16, ep, redundant)
            peaks.append(max(rank_loads(p, SKEWED)[layer]))
        # greedy packing: non-increasing, except for wobbles below 0.5% of the mean once near balance
        slack = 5e-3 * sum(SKEWED[layer]) / ep
        assert all(b <= a + slack for a, b in zip(peaks, peaks[1:], strict=False)), peaks
        assert peaks[-1] < peaks[0]
        # with every expert everywhere, each rank carries exactly the mean
        assert imbalance(rank_loads(plan_placement(SKEWED, ep, 16 * (ep - 1)), SKEWED)[layer]) == pytest.approx(1.0)


def test_the_planner_beats_the_contiguous_default_on_skewed_load():
    default = ExpertPlacement.default(16, 2, [0, 1])
    planned = plan_placement(SKEWED, 2, 0)
    for layer in SKEWED:
        assert max(rank_loads(planned, SKEWED)[layer]) < max(rank_loads(default, SKEWED)[layer])


def test_the_hottest_expert_gets_the_replicas():
    p = plan_placement({0: [1000, 10, 10, 10, 10, 10, 10, 10]}, 2, 2)
    replicas = [sum(e in slots for slots in p.layers[0]) for e in range(8)]
    assert replicas[0] == 2 and sum(replicas) == 10  # at most ep replicas: the second extra goes elsewhere


def test_two_hot_experts_over_four_ranks_get_two_replicas_each_not_three():
    """Giving every redundant slot to the hottest expert per replica would make 3 replicas of each and put both on
    two ranks (busiest 1.33x the mean); two each, one per rank, balance them."""
    load = {0: [500, 500, 1, 1, 1, 1, 1, 1]}
    p = plan_placement(load, ep=4, redundant=4)
    _check_placement(p, 8, 4, 4)
    assert imbalance(rank_loads(p, load)[0]) == pytest.approx(1.0, abs=0.01)
    assert sorted(sum(e in (0, 1) for e in slots) for slots in p.layers[0]) == [1, 1, 1, 1]


def test_the_planner_never_packs_worse_than_the_greedy_replica_choice():
    """The packing-aware choice (placement._plan_layer) keeps the greedy one when nothing beats it."""
    import random

    from shared.sharding.placement import _pack, replica_counts

    rng = random.Random(7)
    for _ in range(200):
        ep = rng.choice([2, 4, 8])
        e = rng.choice([8, 16])
        redundant = ep * rng.randint(0, 2)
        load = [float(int(rng.paretovariate(1.2) * 100)) for _ in range(e)]
        greedy = replica_counts(load, redundant, ep)
        ranks = _pack(load, greedy, ep, (e + redundant) // ep)
        greedy_peak = max(sum(load[x] / greedy[x] for x in slots) for slots in ranks)
        p = plan_placement({0: [int(x) for x in load]}, ep, redundant, e)
        _check_placement(p, e, ep, redundant)
        assert max(rank_loads(p, {0: [int(x) for x in load]})[0]) <= greedy_peak + 1e-6


def test_a_stuck_greedy_still_yields_a_valid_placement():
    # equal loads: the last replicas would pile on one rank; the planner must still place them apart
    for redundant in (2, 4, 6):
        p = plan_placement({0: [5, 5, 5, 5]}, 4, redundant * 2)
        _check_placement(p, 4, 4, redundant * 2)


def test_bad_plans_are_refused_with_the_reason():
    with pytest.raises(PlacementError, match="multiple of ep"):
        plan_placement({0: [1] * 8}, 3, 0)
    with pytest.raises(PlacementError, match="at most"):
        plan_placement({0: [1] * 4}, 2, 6)
    with pytest.raises(PlacementError, match="more experts"):
        plan_placement({0: [1] * 9}, 2, 0, num_experts=8)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ({"0": [[0, 1, 2], [3]]}, "different numbers of slots"),
        ({"0": [[0, 0], [1, 2]]}, "holds an expert twice"),
        ({"0": [[0, 1], [2, 2]]}, "holds an expert twice"),
        ({"0": [[0, 1], [2, 9]]}, r"names expert\(s\) \[9\]"),
        ({"0": [[0, 1], [2, 1]]}, r"expert\(s\) \[3\] are on no rank"),
        ({"0": [[0, 1, 2, 3]]}, "1 ranks listed, ep=2"),
    ],
)
def test_placement_file_validation(tmp_path, layers, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"ep": 2, "num_experts": 4, "layers": layers}))
    with pytest.raises(PlacementError, match=message):
        ExpertPlacement.from_file(path)


def test_placement_files_that_are_not_placements_are_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(PlacementError, match="not JSON"):
        ExpertPlacement.from_file(path)
    path.write_text('{"layers": {}}')
    with pytest.raises(PlacementError, match="need ep, num_experts, layers"):
        ExpertPlacement.from_file(path)


def test_a_placement_round_trips_and_checks_the_model():
    p = plan_placement(SKEWED, 2, 2)
    again = ExpertPlacement.from_json(json.loads(json.dumps(p.to_json())))
    assert again == p
    again.check_model(16, [0, 1], 2)
    with pytest.raises(PlacementError, match="ep=4"):
        again.check_model(16, [0, 1], 4)
    with pytest.raises(PlacementError, match="the model has 8"):
        again.check_model(8, [0, 1], 2)
    with pytest.raises(PlacementError, match="sparse layers are"):
        again.check_model(16, [0, 1, 2], 2)


def test_stats_from_a_real_metrics_scrape():
    metrics.record_expert_load("scrape-model", "prefill", {0: [3, 0, 5, 0], 2: [1, 1, 0, 7]})
    metrics.record_expert_load("scrape-model", "decode", {0: [1, 0, 0, 2]})
    text = metrics.exposition()[0].decode()
    assert metrics.PREFIX + "moe_expert_tokens_total{" in text
    # other tests' samples may share the process registry: keep this model's lines only
    mine = "\n".join(line for line in text.splitlines() if "scrape-model" in line or line.startswith("#"))
    assert parse_stats(mine) == {0: [4, 0, 5, 2], 2: [1, 1, 0, 7]}


def test_stats_from_json_and_a_scrape_without_samples():
    assert parse_stats('{"0": [1, 2], "3": [4, 5.0]}') == {0: [1, 2], 3: [4, 5]}
    with pytest.raises(PlacementError, match="no pdserve:moe_expert_tokens_total"):
        parse_stats("# HELP x\nother_metric 1\n")
    with pytest.raises(PlacementError, match="layer: \\[count per expert\\]"):
        parse_stats('{"0": 5}')


def test_the_cli_writes_a_placement_a_worker_can_load(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({str(k): v for k, v in SKEWED.items()}))
    out = tmp_path / "placement.json"
    assert main(["experts", "plan", "--stats", str(stats), "--ep", "2", "--redundant", "2", "--out", str(out)]) == 0
    p = ExpertPlacement.from_file(out)
    _check_placement(p, 16, 2, 2)
    assert "without replicas ->" in capsys.readouterr().out
    assert main(["experts", "plan", "--stats", str(stats), "--ep", "3", "--out", str(out)]) == 2


def test_the_rank_imbalance_metric_reads_the_busiest_rank_over_the_mean():
    from shared.model.expert_parallel import RankLoad

    load = RankLoad(per_rank=[30, 10], peak=30)  # one forward: 30 and 10 pairs
    assert load.imbalance == pytest.approx(1.5)
    metrics.record_rank_load("imbalance-model", "decode", load.per_rank, load.imbalance)
    metrics.record_rank_load("imbalance-model", "decode", [0, 0], 1.0)  # an idle interval keeps the last value
    text = metrics.exposition()[0].decode()
    assert 'pdserve:moe_rank_imbalance{model_name="imbalance-model",role="decode"} 1.5' in text
    assert 'pdserve:moe_rank_tokens_total{model_name="imbalance-model",rank="0",role="decode"} 30.0' in text
    assert 'pdserve:moe_rank_imbalance_ratio_count{model_name="imbalance-model",role="decode"} 1.0' in text
