"""shared/engine/build_thread.py: a build on a thread of its own, its result or its error on the caller's."""

from __future__ import annotations

import threading

import pytest

from shared.engine.build_thread import on_a_passing_thread


def test_the_build_runs_on_another_thread_that_has_ended_by_the_return():
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_a_passing_thread(build) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_what_the_build_raises_is_raised_on_the_caller():
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_a_passing_thread(build)
