"""services.local.restarts: the supervisor's backoff and crash-loop bookkeeping, on a fake clock."""

from __future__ import annotations

import pytest

from services.local.restarts import RestartPolicy, RestartRecord

POLICY = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, healthy_after_s=30.0, max_exits=5, window_s=60.0)


def crash(record: RestartRecord, now: float, ran_s: float = 1.0) -> float | None:
    """The service ran `ran_s` seconds from `now` and exited; restarted after the delay unless given up."""
    delay = record.exited(now + ran_s)
    if delay is not None:
        record.restarted(now + ran_s + delay)
    return delay


def test_delay_doubles_up_to_the_cap_and_gives_up_on_a_crash_loop():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=1.5, max_exits=5, window_s=60.0)
    record = RestartRecord(policy, now=0.0)
    delays = [crash(record, now=t) for t in (0.0, 10.0, 20.0, 30.0)]
    assert delays == [0.5, 1.0, 1.5, 1.5]
    assert record.restarts == 4
    assert crash(record, now=40.0) is None  # the fifth exit within 60 s
    assert record.recent_exits == 5


def test_exits_spread_over_more_than_the_window_never_give_up():
    record = RestartRecord(POLICY, now=0.0)
    for i in range(20):  # one exit every 20 s: never five within 60 s
        assert crash(record, now=i * 20.0, ran_s=19.0) is not None
    assert record.restarts == 20


def test_a_healthy_run_resets_the_delay():
    record = RestartRecord(RestartPolicy(first_delay_s=0.5, healthy_after_s=30.0, max_exits=10), now=0.0)
    assert [crash(record, now=t) for t in (0.0, 2.0, 5.0)] == [0.5, 1.0, 2.0]
    assert crash(record, now=record.started_at, ran_s=31.0) == 0.5  # ran past healthy_after_s
    assert crash(record, now=record.started_at) == 1.0


@pytest.mark.parametrize(
    "kwargs", [{"first_delay_s": 0}, {"first_delay_s": 5, "max_delay_s": 1}, {"max_exits": 0}, {"window_s": 0}]
)
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
