#!/usr/bin/env python3
"""Follow the planner's desired worker counts with `docker compose --scale` (docs/deploy.md, "Compose scaling").

    python3 docker/compose_autoscale.py PLANNER_METRICS_URL [--interval S] [--max N] [--once]

Run it where you run `docker compose` (the directory of compose.yaml). Every interval (30 s) it reads
`pdserve:planner_desired_workers{role="prefill"|"decode"}` from the planner's Prometheus exposition at the URL and,
when a count differs from the last one applied, runs

    docker compose up -d --no-recreate --scale prefill=P --scale decode=D prefill decode

New replicas start; surplus ones get SIGTERM and drain within stop_grace_period (a prefill worker until its held
KV is pulled or its lease expires). While the planner does not answer, or gives no count for a role, the counts
stay as they are. Each count is kept within 1..--max (8): one worker of each role at least. Standard library only:
the host that runs compose needs nothing more than python3.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

METRIC = "pdserve:planner_desired_workers"
ROLES = ("prefill", "decode")
_SAMPLE = re.compile(rf"^{re.escape(METRIC)}\{{([^}}]*)\}}\s+(\S+)", re.M)
_ROLE = re.compile(r'(?:^|,)\s*role="([^"]*)"')

Counts = dict[str, int]


def desired(exposition: str) -> Counts:
    """The desired count of each role in a Prometheus text exposition (the largest, where several series give one:
    several models, or planner replicas); a role without a finite value is left out."""
    counts: Counts = {}
    for labels, value in _SAMPLE.findall(exposition):
        role = _ROLE.search(labels)
        number = float(value)
        if role is None or not math.isfinite(number):
            continue
        counts[role.group(1)] = max(counts.get(role.group(1), 0), math.ceil(number))
    return counts


def scale_command(counts: Counts) -> list[str]:
    scales = [arg for role in ROLES for arg in ("--scale", f"{role}={counts[role]}")]
    return ["docker", "compose", "up", "-d", "--no-recreate", *scales, *ROLES]


def read(url: str, timeout_s: float = 5.0) -> Counts | None:
    """The planner's counts, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return desired(response.read().decode())
    except OSError as exc:
        print(f"compose-autoscale: the planner does not answer ({exc}): keeping the counts", file=sys.stderr)
        return None


def step(found: Counts | None, applied: Counts | None, most: int, run: Callable[[list[str]], int]) -> Counts | None:
    """One round: the counts now applied (`applied` when nothing changed or nothing could be applied)."""
    if found is None or not set(ROLES) <= set(found):
        return applied
    wanted = {role: min(most, max(1, found[role])) for role in ROLES}
    if wanted == applied:
        return applied
    command = scale_command(wanted)
    print("compose-autoscale: " + " ".join(command), flush=True)
    return wanted if run(command) == 0 else applied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compose_autoscale.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the planner's /metrics URL")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between rounds (default 30)")
    parser.add_argument("--max", type=int, default=8, help="most workers of a role (default 8)")
    parser.add_argument("--once", action="store_true", help="one round, then exit")
    args = parser.parse_args(argv)
    applied: Counts | None = None
    while True:
        applied = step(read(args.url), applied, args.max, lambda command: subprocess.run(command).returncode)
        if args.once:
            return 0 if applied is not None else 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
