"""Where a process's CPU goes, thread by thread: each thread's share of a core over a window, by its OS name.

    .venv/bin/python benchmarks/thread_cpu.py PID [--seconds 15] [--json PATH]

Reads /proc/PID/task/*/stat (user + system ticks) at the start and the end of the window. A worker names its
engine thread "engine" (shared/thread_names.py); its event loop is the process's main thread (named after the
interpreter, "python"); the others carry their library's names (gloo's loop, NATS's reader ...). Counted ticks,
not samples: a thread that waits costs nothing, and the other processes on the host change only how much CPU the
process gets in all, which the total says. Linux only.

Used to tell whether a decode worker's time outside the engine's step is its loop's work (handing over outputs,
publishing token events) or the engine's own steps running slower in a stack than alone: docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.host_info import cpu_info  # noqa: E402


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """tid → (its name, user + system ticks so far) of every live thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # it ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]))  # utime, stime (fields 14 and 15 of stat)
    return out


def cores_by_thread(pid: int, seconds: float) -> dict[str, float]:
    """Each thread name's share of a core over the next `seconds` (threads of one name summed), the most first."""
    before, t0 = thread_ticks(pid), time.monotonic()
    time.sleep(seconds)
    after, elapsed = thread_ticks(pid), time.monotonic() - t0
    per_tick = 1 / os.sysconf("SC_CLK_TCK") / elapsed
    shares: dict[str, float] = defaultdict(float)
    for tid, (name, ticks) in after.items():
        shares[name] += (ticks - before.get(tid, (name, 0))[1]) * per_tick
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pid", type=int)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--json", help="write the shares and the host here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    shares = cores_by_thread(args.pid, args.seconds)
    cmdline = Path(f"/proc/{args.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    print(f"{cmdline[:120]}\n{args.seconds:g} s, load average {load_before[0]:.2f} → {os.getloadavg()[0]:.2f}")
    for name, cores in shares.items():
        if cores >= 0.001:
            print(f"  {name:16s} {cores:6.3f} cores")
    print(f"  {'total':16s} {sum(shares.values()):6.3f} cores")
    if args.json:
        doc = dict(host=cpu_info(), pid=args.pid, cmdline=cmdline, seconds=args.seconds, load_before=load_before,
                   load_after=os.getloadavg(), cores=shares)  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
