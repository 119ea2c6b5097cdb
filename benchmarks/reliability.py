"""The fault scenarios of tests/test_faults.py under more load, and the table docs/reliability.md quotes.

    .venv/bin/python benchmarks/reliability.py                 # 24 concurrent streams per scenario
    .venv/bin/python benchmarks/reliability.py --requests 48 --json out.json

It runs the scenario tests themselves (pytest, CHAOS_REQUESTS streams each) and collects what every scenario
recorded: requests sent, completed (full answer equal to the single-process engine's), failed cleanly (an
OpenAI-shaped error) and lost (anything else), and how many requests the gateway moved to another worker
(pdserve:request_migrations_total). A scenario whose checks fail (a lost request, a leaked block or
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
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/test_faults.py")]
        if args.k:
            cmd += ["-k", args.k]
        status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        rows = [line.rstrip("\n").split("\t") for line in report if line.strip()]

    keys = ("sent", "completed", "failed_cleanly", "lost", "moved")
    results = [{"scenario": row[0]} | dict(zip(keys, map(int, row[1:]), strict=True)) for row in rows]
    width = max([len(r["scenario"]) for r in results] + [8])
    print(f"\n{'scenario':<{width}}  {'sent':>5} {'completed':>9} {'failed cleanly':>14} {'lost':>5} {'moved':>6}")
    for r in results:
        print(f"{r['scenario']:<{width}}  {r['sent']:>5} {r['completed']:>9} {r['failed_cleanly']:>14} {r['lost']:>5}"
              f" {r['moved']:>6}")  # fmt: skip
    Path(args.json).write_text(json.dumps({"requests_per_scenario": args.requests, "pytest_status": status,
                                           "scenarios": results}, indent=2))  # fmt: skip
    print(f"\nwritten to {args.json}; pytest exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
