"""benchmarks/link_emulation.py: the namespaces and veth pair of the emulated link are built, capped and removed,
also when building fails midway or the block raises; stale namespaces of dead runs are swept. Needs root and
iproute2 (skipped otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import link_emulation
from benchmarks.link_emulation import PREFIX, VethLink, namespaces, sweep_stale, tbf_burst_bytes, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"link emulation: {unavailable()}")


def test_link_is_built_capped_and_removed():
    with VethLink.create() as link:
        assert {link.netns("p"), link.netns("d")} <= set(namespaces())
        link.cap(2)
        shown = subprocess.run([*link.exec_in("p"), "tc", "qdisc", "show", "dev", link.device("p")],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" in shown and "2Gbit" in shown
        link.cap(None)
        shown = subprocess.run([*link.exec_in("d"), "tc", "qdisc", "show", "dev", link.device("d")],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" not in shown
    assert not {link.netns("p"), link.netns("d")} & set(namespaces())


def test_a_raise_inside_the_block_removes_the_link():
    with pytest.raises(ZeroDivisionError), VethLink.create() as link:
        names = {link.netns("p"), link.netns("d")}
        assert names <= set(namespaces())
        1 / 0  # noqa: B018
    assert not names & set(namespaces())


def test_a_failure_while_building_removes_what_was_made(monkeypatch):
    real = link_emulation._run

    def failing(*argv: str) -> None:
        if argv[:3] == ("ip", "link", "add"):  # after both namespaces exist
            raise RuntimeError("injected: veth refused")
        real(*argv)

    monkeypatch.setattr(link_emulation, "_run", failing)
    before = set(namespaces())
    with pytest.raises(RuntimeError, match="injected"):
        VethLink.create()
    assert set(namespaces()) == before


def test_stale_namespaces_of_dead_runs_are_swept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names a run that no longer exists
    stale = f"{PREFIX}{dead.pid}-p"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_burst_is_small_against_the_transfers():
    assert tbf_burst_bytes(1) == 128 << 10  # the floor: two GSO packets
    assert tbf_burst_bytes(25) == int(25e9 / 8 / 1000)  # 1 ms of tokens, 3.1 MB
