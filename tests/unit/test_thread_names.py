"""The engine thread carries its name where the operating system shows it (shared/thread_names.py), so its CPU
can be told from the event loop's (benchmarks/thread_cpu.py)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.thread_cpu import cores_by_thread, thread_ticks
from shared.thread_names import name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def test_a_named_thread_shows_under_its_name_and_its_cpu_is_its_own():
    stop, named = threading.Event(), threading.Event()

    def spin() -> None:
        assert name_this_thread("a-very-long-thread-name")  # cut to the kernel's 15 bytes
        named.set()
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        named.wait(5)
        assert Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip() == "a-very-long-thr"
        assert thread_ticks(os.getpid())[thread.native_id][0] == "a-very-long-thr"
        shares = cores_by_thread(os.getpid(), 0.5)
        assert shares["a-very-long-thr"] > 0.05  # it spun; this thread slept
    finally:
        stop.set()
        thread.join()
