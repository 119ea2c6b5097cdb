"""The fault scenarios of tests/e2e/test_faults.py under more load, and the table docs/reliability.md quotes.

    .venv/bin/python benchmarks/reliability.py                 # 24 concurrent streams per scenario
    .venv/bin/python benchmarks/reliability.py --requests 48 --json out.json

It runs the scenario tests themselves (pytest, CHAOS_REQUESTS streams each) and collects what every scenario
recorded: requests sent, completed (full answer equal to the single-process engine's), failed cleanly (an
OpenAI-shaped error) and lost (anything else), and how many requests the gateway moved to another worker
(pdserve:request_migrations_total), and the streams' stall (p50 / p99 of each one's longest gap between two tokens)
and first-token wait. A scenario whose checks fail (a lost request, a leaked block or
Redis key) fails its test: the exit status says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="concurrent streams per scenario")
    parser.add_argument("-k", default=None, help="only the scenarios pytest -k selects")
    parser.add_argument("--json", default="reliability.json", help="where to write the results")
    args = parser.parse_args()

    with tempfile.NamedTemporaryFile("r", suffix=".tsv") as report:
        env = os.environ | {"CHAOS_REQUESTS": str(args.requests), "CHAOS_REPORT": report.name}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/e2e/test_faults.py")]
        if args.k:
            cmd += ["-k", args.k]
        status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        rows = [line.rstrip("\n").split("\t") for line in report if line.strip()]

    counts = ("sent", "completed", "failed_cleanly", "lost", "moved")
    timings = ("stall_p50_s", "stall_p99_s", "first_token_p50_s", "first_token_p99_s")  # "-": not measured
    results = [{"scenario": row[0]} | dict(zip(counts, map(int, row[1:6]), strict=True))
               | dict(zip(timings, (None if t == "-" else float(t) for t in row[6:]), strict=True))
               for row in rows]  # fmt: skip
    width = max([len(row[0]) for row in rows] + [8])
    print(f"\n{'scenario':<{width}}  {'sent':>5} {'completed':>9} {'failed cleanly':>14} {'lost':>5} {'moved':>6}"
          f" {'stall p50/p99 s':>16} {'1st token p50/p99 s':>20}")  # fmt: skip
    for r in results:
        stall, first = (f"{r[a] or 0:.2f}/{r[b] or 0:.2f}" if r[a] is not None else "-"
                        for a, b in (timings[:2], timings[2:]))  # fmt: skip
        print(f"{r['scenario']:<{width}}  {r['sent']:>5} {r['completed']:>9} {r['failed_cleanly']:>14} {r['lost']:>5}"
              f" {r['moved']:>6} {stall:>16} {first:>20}")  # fmt: skip
    Path(args.json).write_text(json.dumps({"requests_per_scenario": args.requests, "pytest_status": status,
                                           "scenarios": results}, indent=2))  # fmt: skip
    print(f"\nwritten to {args.json}; pytest exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
