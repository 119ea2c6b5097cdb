"""benchmarks/link_emulation.py: the namespaces and veth pair of the emulated link are built, capped and removed,
also when building fails midway or the block raises; stale namespaces of dead runs are swept; a network of hosts
is built, each host its own hostname and /dev/shm, reachable from here, cut and mended, and removed with the
cable end it had here. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from benchmarks import link_emulation
from benchmarks.link_emulation import (
    PREFIX,
    HostNetwork,
    VethLink,
    hosts_unavailable,
    namespaces,
    sweep_stale,
    tbf_burst_bytes,
    unavailable,
)

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


def _on(net: HostNetwork, host: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([*net.exec_in(host), sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(hosts_unavailable() is not None, reason=f"host network: {hosts_unavailable()}")
def test_a_host_network_is_built_cut_mended_and_removed():
    with HostNetwork.create(["alpha", "beta"]) as net:
        names = {net.netns(h) for h in ("alpha", "beta", "switch")}
        assert names <= set(namespaces())
        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="pdtest-") as here:  # not on a host's /dev/shm
            look = f"import os, socket; print(socket.gethostname(), os.path.exists({here.name!r}))"
            seen = [_on(net, h, look).stdout.split() for h in ("alpha", "beta")]
        assert seen == [["alpha", "False"], ["beta", "False"]]  # a hostname and a /dev/shm of its own
        listen = (f"import socket; s = socket.create_server(({net.address('alpha')!r}, 9090)); print('up', flush=True);"
                  " c, peer = s.accept(); print(peer[0])")  # fmt: skip
        server = subprocess.Popen(
            [*net.exec_in("alpha"), sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            net.cut("beta")
            dial = f"import socket; socket.create_connection(({net.address('alpha')!r}, 9090), timeout=1)"
            assert _on(net, "beta", dial).returncode != 0  # its cable is out: nothing gets through
            net.mend("beta")
            assert _on(net, "beta", dial.replace("timeout=1", "timeout=10")).returncode == 0
            assert server.stdout.readline().strip() == net.address("beta")  # seen from alpha at beta's address
        finally:
            server.kill()
            server.wait()
        net.cap("alpha", 2)
        shown = subprocess.run(["ip", "netns", "exec", net.netns("alpha"), "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" in shown and "2Gbit" in shown
        placed = net.placement({"nats": "alpha", "redis": "alpha", "decode-1": "beta", "decode-2": "alpha"})
        assert [placed.port(s) for s in ("nats", "redis", "decode-1", "decode-2")] == [4222, 6379, 9090, 9090]
        assert placed.address("decode-2") == net.address("alpha") and placed.prefix("decode-1") == net.exec_in("beta")
        device = net.client_device
    assert not names & set(namespaces())
    assert subprocess.run(["ip", "link", "show", "dev", device], capture_output=True).returncode != 0
