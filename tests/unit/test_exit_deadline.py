"""A stopping service ends itself by its deadline (shared/telemetry/lifecycle.py exit_by), in a process of its
own: the deadline ends the whole process."""

from __future__ import annotations

import subprocess
import sys

STUCK = "import time; from shared.telemetry.lifecycle import exit_by; exit_by({}); exit_by(60); time.sleep(30)"


def test_a_process_still_running_at_its_deadline_ends_itself():
    # within the timeout only if the first deadline held: the later exit_by(60) must not move it
    done = subprocess.run([sys.executable, "-c", STUCK.format(0.3)], capture_output=True, text=True, timeout=25)
    assert done.returncode == 1
    assert "exiting now" in done.stderr


def test_a_process_that_exits_in_time_is_not_touched():
    code = "from shared.telemetry.lifecycle import exit_by; exit_by(30); print('done')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert (done.returncode, done.stdout.strip()) == (0, "done")  # a daemon timer does not hold the exit
