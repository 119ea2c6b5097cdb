"""Free ports: below the ephemeral range, free when handed out, never handed out twice by one process."""

from __future__ import annotations

import socket

import pytest

from shared import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_never_repeated():
    first, _ = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    assert all(10000 <= p < first for p in picked), sorted(picked)[-5:]
    with socket.socket() as s:  # handed out, and free: binding it works
        s.bind(("127.0.0.1", picked[-1]))


def test_a_port_in_use_is_skipped_and_a_spent_range_falls_back_to_the_kernel(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # the only candidates: the busy port and one beside it (or below it, at the top of the port space)
        other = busy + 1 if busy < 65535 else busy - 1
        monkeypatch.setattr(ports, "candidate_ports", lambda: range(min(busy, other), max(busy, other) + 1))
        monkeypatch.setattr(ports, "_handed_out", set())
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", other))
            except OSError:
                pytest.skip(f"port {other} is in use on this host")
        assert ports.free_port() == other  # never the busy one
        with socket.socket() as served:  # its server binds it, as a stack's service would
            served.bind(("127.0.0.1", other))
            fallback = ports.free_port()  # both candidates spent: the kernel's pick, from its ephemeral range
        first, last = ports.ephemeral_range()
        assert fallback not in (busy, other) and first <= fallback <= last


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(monkeypatch, tmp_path):
    spec = tmp_path / "ip_local_port_range"
    spec.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", spec)
    assert ports.ephemeral_range() == (40000, 50000) and ports.candidate_ports() == range(10000, 40000)
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)
    spec.write_text("9000 60999")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", spec)
    assert len(ports.candidate_ports()) == 0  # then only the kernel's pick
