"""A plan check's runs again through `pdserve plan`'s model, with and without the serving plane's CPU on the workers'
cores: which form of the model predicts the measured TPOT better, on runs already made.

    .venv/bin/python benchmarks/plan_models.py RUN.json [RUN.json ...] [--json PATH]

Each RUN.json is a `benchmarks/plan_check.py` output; its profile is the file the run names (`profile`: the run's
own, `<out>_profile.json`, unless it was given one). The run's requests are drawn again from its own arguments
(the same workload and seed, so the same requests), and each measured split is predicted twice on the run's
budget of cores: `--plane-cpu separate` (no plane term) and `shared` with the client's CPU (as plan_check.py plans).
Per split it prints TPOT p50 and p90 predicted over measured (the medians of its rounds with --rounds); over all
splits of all runs, each form's geometric mean of the p50 ratio and its mean |log| (the typical error either way).
Pure arithmetic on recorded data: it starts no stack.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.plan_check import deployment_of, parse_args  # noqa: E402
from services.planning.model import PLANE_CPU, PerformanceModel, Slos  # noqa: E402
from services.planning.profile_file import load_profile  # noqa: E402
from services.planning.workload import from_lengths  # noqa: E402


def run_rows(path: Path) -> list[dict]:
    """Each measured split of one plan check, predicted by each form of the model."""
    data = json.loads(path.read_text())
    args = parse_args(data["argv"])
    profile = load_profile(data["profile"])
    cores = len(args.cores.split(","))
    sims = from_lengths(args.rate, args.isl, args.osl, args.range_ratio).requests(
        max(1, int(args.rate * args.duration)), args.seed
    )
    slos = Slos(args.ttft_ms / 1e3, args.tpot_ms / 1e3)
    models = {form: PerformanceModel(profile, form, client_cpu=True) for form in PLANE_CPU}
    rows = []
    for split in data["splits"]:
        measured = split["measured"]
        row = {"run": path.stem, "split": split["name"], "measured_tpot_ms": [measured["median_tpot_ms"],
                                                                             measured["p90_tpot_ms"]]}  # fmt: skip
        for form, model in models.items():
            p = model.predict(deployment_of(split["deployment"]), sims, slos, cores)
            row[form] = [p.tpot_p50_s * 1e3 / measured["median_tpot_ms"], p.tpot_p90_s * 1e3 / measured["p90_tpot_ms"]]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="plan_check.py output JSON files")
    ap.add_argument("--json", help="write the rows and the summary here")
    args = ap.parse_args()
    rows = [row for run in args.runs for row in run_rows(Path(run))]
    print("| run | split | measured TPOT p50 / p90 ms | " + " | ".join(
        f"pred / meas, plane {form} (p50 / p90)" for form in PLANE_CPU) + " |")  # fmt: skip
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in PLANE_CPU) + " |")
    for r in rows:
        cells = " | ".join(f"{r[form][0]:.2f} / {r[form][1]:.2f}" for form in PLANE_CPU)
        print(f"| {r['run']} | {r['split']} | {r['measured_tpot_ms'][0]:.1f} / {r['measured_tpot_ms'][1]:.1f} | "
              f"{cells} |")  # fmt: skip
    summary = {}
    for form in PLANE_CPU:
        logs = [math.log(r[form][0]) for r in rows]
        summary[form] = {"geometric_mean": math.exp(sum(logs) / len(logs)),
                         "mean_abs_log": sum(abs(x) for x in logs) / len(logs),
                         "range": [math.exp(min(logs)), math.exp(max(logs))]}  # fmt: skip
        s = summary[form]
        print(f"plane {form}: TPOT p50 predicted / measured over {len(rows)} split-runs: geometric mean "
              f"{s['geometric_mean']:.2f}, mean |log| {s['mean_abs_log']:.3f}, range {s['range'][0]:.2f}-"
              f"{s['range'][1]:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
