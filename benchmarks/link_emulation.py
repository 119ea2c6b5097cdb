"""Emulated networks on one machine, made of network namespaces (root and iproute2 needed):

- `VethLink`, a link between two machines: two namespaces joined by a veth pair, its rate capped by a
  token-bucket qdisc (`tc ... tbf`) on both ends (benchmarks/kv_link_bench.py);

    with VethLink.create() as link:          # pdbench-<pid>-p and pdbench-<pid>-d, 10.213.0.1 ↔ 10.213.0.2
        link.cap(10)                          # 10 Gb/s each way; link.cap(None): uncapped
        subprocess.run([*link.exec_in("p"), "python", ...])

- `HostNetwork`, a LAN of hosts: one namespace per host, each with its own `eth0` cabled (a veth pair) to a
  bridge in a namespace of its own (the switch), and this machine plugged in too as a client of the network;
  a cable can be capped (`cap`) or cut and mended (`cut`, `mend`: its switch port down/up, the host sees its
  carrier go). A host's commands (`exec_in`) also get a hostname and a /dev/shm of their own, so that nothing
  of one host's looks shared with another's (shared/kv/transfer/shm.py's host identity differs, as it does
  between machines). `placement` spreads a local stack's services over the hosts (services/local/hosts.py):
  tests/e2e/test_across_hosts.py.

    with HostNetwork.create(["infra", "prefill", "decode0"]) as net:   # 10.77.0.1, .2, .3; this machine .254
        subprocess.run([*net.exec_in("prefill"), "python", ...])

Only the rate is emulated: `tbf` works here, `netem` (added delay, loss) does not, so links have loopback-like
latency. Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not, for a caller to skip with a message.

Nothing stays behind: every device lives in a namespace of ours (but this machine's end of its cable into a
HostNetwork, whose other end is in the switch's), so deleting the namespaces removes everything; `close()` runs
on exit from the `with` block, and `terminate_on_signals()` turns SIGTERM/SIGHUP into SystemExit so that exit
happens on those too (SIGINT already raises KeyboardInterrupt). A SIGKILL leaves the namespaces, named after
the dead pid: `sweep_stale()`, run by each `create()`, removes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PREFIX = "pdbench-"
_OURS = re.compile(rf"^{PREFIX}(\d+)-[a-z0-9]+$")  # <prefix><creator's pid>-<side or host>
SUBNET = "10.213.0"  # a /30 inside each pair of namespaces; namespaces do not share routes, so pairs never clash
ADDRESS = {"p": f"{SUBNET}.1", "d": f"{SUBNET}.2"}
TBF_LATENCY = "20ms"  # queue bound of the bucket: packets that would wait longer are dropped (TCP backs off)


def unavailable() -> str | None:
    """Why a link cannot be emulated here (None: it can)."""
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    return None


def hosts_unavailable() -> str | None:
    """Why a HostNetwork cannot be built here (None: it can): unavailable()'s reasons, or no `unshare`."""
    if reason := unavailable():
        return reason
    return None if shutil.which("unshare") else "unshare not found (util-linux)"


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete `pdbench-*` namespaces whose creator is gone (a SIGKILLed run), and any not of our naming; their names."""
    removed = []
    for name in namespaces():
        if not name.startswith(PREFIX):
            continue
        match = _OURS.match(name)
        if match and _alive(int(match.group(1))) and int(match.group(1)) != os.getpid():
            continue  # another live run's
        with contextlib.suppress(RuntimeError):
            _run("ip", "netns", "del", name)
            removed.append(name)
    return removed


def tbf_burst_bytes(gbit: float) -> int:
    """Bucket depth: 1 ms of tokens, at least 128 KiB (a GSO packet of 64 KiB must fit, twice). Small against
    the transfers measured (≥ 1 MB), so a burst does not hide the cap."""
    return max(128 << 10, int(gbit * 1e9 / 8 / 1000))


@dataclass
class VethLink:
    """Namespaces `<prefix><pid>-p` (prefill side) and `-d` (decode side), veth ends `pdb<pid>p` / `pdb<pid>d`."""

    tag: str  # the creator's pid, in every name

    @classmethod
    def create(cls) -> VethLink:
        """Sweep stale namespaces, then build the pair (a failure midway removes what was made)."""
        sweep_stale()
        link = cls(str(os.getpid()))
        try:
            for side in "pd":
                _run("ip", "netns", "add", link.netns(side))
            _run("ip", "link", "add", link.device("p"), "netns", link.netns("p"), "type", "veth",
                 "peer", "name", link.device("d"), "netns", link.netns("d"))  # fmt: skip
            for side in "pd":
                ns, dev = link.netns(side), link.device(side)
                _run("ip", "-n", ns, "addr", "add", f"{ADDRESS[side]}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            link.close()
            raise
        return link

    def netns(self, side: str) -> str:
        return f"{PREFIX}{self.tag}-{side}"

    def device(self, side: str) -> str:
        return f"pdb{self.tag}{side}"  # at most 3 + 7 + 1 characters: within IFNAMSIZ (15)

    def address(self, side: str) -> str:
        return ADDRESS[side]

    def exec_in(self, side: str) -> list[str]:
        """The argv prefix that runs a command in that side's namespace."""
        return ["ip", "netns", "exec", self.netns(side)]

    def cap(self, gbit: float | None) -> None:
        """Cap both directions at `gbit` Gb/s (token bucket); None removes the caps."""
        for side in "pd":
            _cap_device(self.netns(side), self.device(side), gbit)

    def close(self) -> None:
        """Delete both namespaces (their veth ends go with them). Idempotent."""
        present = set(namespaces())
        for side in "pd":
            if self.netns(side) in present:
                with contextlib.suppress(RuntimeError):
                    _run("ip", "netns", "del", self.netns(side))

    def __enter__(self) -> VethLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cap_device(ns: str, dev: str, gbit: float | None) -> None:
    """Cap what `dev` (in namespace `ns`) sends at `gbit` Gb/s (token bucket); None removes the cap."""
    if gbit is None:
        with contextlib.suppress(RuntimeError):  # no qdisc of ours there: nothing to remove
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
        return
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", f"{gbit}gbit", "burst", str(tbf_burst_bytes(gbit)), "latency", TBF_LATENCY)  # fmt: skip


HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # a namespace suffix, a switch port's name and a hostname at once
SWITCH = "switch"  # the namespace of the bridge (never a host's name)
CLIENT_OCTET = 254  # this machine's address on a HostNetwork: <subnet>.254
# A host's commands run with a hostname and a /dev/shm of their own (fresh UTS and mount namespaces; `ip netns
# exec` shares neither): $0 is the hostname, the command follows. Each `exec`: the pid stays the command's.
_OWN_HOST = 'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"'


def free_subnet() -> str:
    """The first 10.77.<n> (/24) that no route of this machine's already covers: ours becomes reachable from
    here without hiding anything this machine reaches now."""
    for n in range(256):
        subnet = f"10.77.{n}"
        route = subprocess.run(["ip", "-4", "route", "get", f"{subnet}.1"], capture_output=True, text=True)
        if route.returncode != 0 or " via " in route.stdout:  # unreachable, or only by the default route
            return subnet
    raise RuntimeError("no free 10.77.<n>.0/24 subnet on this machine")


@dataclass
class HostNetwork:
    """Hosts on one LAN (see the module docstring): namespace `<prefix><pid>-<host>` each, with `eth0` at
    <subnet>.<i> (i = 1, 2, ... in the order given); the bridge `br0` in `<prefix><pid>-switch`, a port per host
    named as the host; this machine's end of its cable `pdh<pid>` at <subnet>.254."""

    tag: str  # the creator's pid, in every name
    subnet: str  # the first three octets
    hosts: tuple[str, ...]

    @classmethod
    def create(cls, hosts: Sequence[str]) -> HostNetwork:
        """Sweep stale namespaces, then build the network (a failure midway removes what was made)."""
        if bad := [h for h in hosts if not HOST_NAME.match(h) or h == SWITCH]:
            raise ValueError(f"host names must match {HOST_NAME.pattern} (not {SWITCH!r}): {bad}")
        if len(set(hosts)) != len(hosts) or not 0 < len(hosts) < CLIENT_OCTET:
            raise ValueError(f"1 to {CLIENT_OCTET - 1} distinct hosts, got {list(hosts)}")
        sweep_stale()
        net = cls(str(os.getpid()), free_subnet(), tuple(hosts))
        try:
            switch = net.netns(SWITCH)
            _run("ip", "netns", "add", switch)
            _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", switch, "link", "set", "br0", "up")
            for host in hosts:
                ns = net.netns(host)
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", switch, "link", "add", "name", host, "type", "veth",
                     "peer", "name", "eth0", "netns", ns)  # fmt: skip
                net._plug(host)
                _run("ip", "-n", ns, "addr", "add", f"{net.address(host)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "name", net.client_device, "type", "veth",
                 "peer", "name", "client", "netns", switch)  # fmt: skip
            net._plug("client")
            _run("ip", "addr", "add", f"{net.client_address}/24", "dev", net.client_device)
            _run("ip", "link", "set", net.client_device, "up")
        except BaseException:
            net.close()
            raise
        return net

    def _plug(self, port: str) -> None:
        switch = self.netns(SWITCH)
        _run("ip", "-n", switch, "link", "set", "dev", port, "master", "br0")
        _run("ip", "-n", switch, "link", "set", "dev", port, "up")

    def netns(self, host: str) -> str:
        return f"{PREFIX}{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    @property
    def client_address(self) -> str:
        """This machine's address on the network."""
        return f"{self.subnet}.{CLIENT_OCTET}"

    @property
    def client_device(self) -> str:
        return f"pdh{self.tag}"  # at most 3 + 7 characters: within IFNAMSIZ (15)

    def exec_in(self, host: str) -> list[str]:
        """The argv prefix that runs a command on `host`: in its namespace, with its own hostname and /dev/shm."""
        return ["ip", "netns", "exec", self.netns(host), "unshare", "--uts", "--mount", "sh", "-c", _OWN_HOST, host]

    def cap(self, host: str, gbit: float | None) -> None:
        """Cap `host`'s cable at `gbit` Gb/s each way (its eth0 and its switch port); None removes the caps."""
        _cap_device(self.netns(host), "eth0", gbit)
        _cap_device(self.netns(SWITCH), host, gbit)

    def cut(self, host: str) -> None:
        """Pull `host`'s cable at the switch: its packets go nowhere (its eth0 loses carrier, its addresses
        stay), as when a link between machines fails; no connection is closed, they time out."""
        _run("ip", "-n", self.netns(SWITCH), "link", "set", "dev", host, "down")

    def mend(self, host: str) -> None:
        """Plug `host`'s cable back in."""
        _run("ip", "-n", self.netns(SWITCH), "link", "set", "dev", host, "up")

    def placement(self, where: dict[str, str]) -> HostPlacement:
        """A local stack's services on these hosts: `where` maps each service ("nats", "redis", "gateway",
        "prefill-0", ...) to its host (services/local/hosts.py)."""
        if unknown := {h for h in where.values() if h not in self.hosts}:
            raise ValueError(f"no such hosts on this network: {sorted(unknown)}")
        return HostPlacement(self, dict(where))

    def close(self) -> None:
        """Delete this machine's cable end and every namespace (the devices in them go along). Idempotent."""
        with contextlib.suppress(RuntimeError):  # gone already, or never made
            _run("ip", "link", "del", "dev", self.client_device)
        present = set(namespaces())
        for host in (*self.hosts, SWITCH):
            if self.netns(host) in present:
                with contextlib.suppress(RuntimeError):
                    _run("ip", "netns", "del", self.netns(host))

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


WELL_KNOWN_PORTS = {"nats": 4222, "redis": 6379}  # each host is a fresh namespace: nothing else listens there
METRICS_PORT = 9090  # a worker's /metrics; the next ones up for more services on one host


@dataclass
class HostPlacement:
    """services/local/hosts.py's ServiceHosts over a HostNetwork: each service at its host's address, started
    under its host's `exec_in`, on the ports a deployment would give it (a namespace of ours has nothing else
    listening, so the standard ones are free)."""

    network: HostNetwork
    where: dict[str, str]  # service → host
    _ports: dict[str, int] = field(default_factory=dict)

    def host(self, service: str) -> str:
        if service not in self.where:
            raise KeyError(f"{service!r} has no host in this placement ({sorted(self.where)})")
        return self.where[service]

    def address(self, service: str) -> str:
        return self.network.address(self.host(service))

    def prefix(self, service: str) -> list[str]:
        return self.network.exec_in(self.host(service))

    def port(self, service: str) -> int:
        if service not in self._ports:
            taken = {p for s, p in self._ports.items() if self.where[s] == self.host(service)}
            port = WELL_KNOWN_PORTS.get(service, METRICS_PORT)
            while port in taken:
                port += 1
            self._ports[service] = port
        return self._ports[service]


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise SystemExit (so `finally` and `with` exits run); restored after."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- raw throughput through the link: a plain TCP stream, the check that a cap is what it says --------------

RAW_PORT = 47611


def raw_throughput_gbps(link: VethLink, nbytes: int, python: str) -> float:
    """Gb/s of one TCP stream of `nbytes` from the prefill side to the decode side (timed by the receiver, from
    its first byte to its last; the connection's setup is not in it)."""
    script = os.path.abspath(__file__)
    sink = subprocess.Popen([*link.exec_in("d"), python, script, "sink", str(RAW_PORT), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "listening":
            raise RuntimeError("the raw-throughput sink did not start")
        _run(*link.exec_in("p"), python, script, "source", link.address("d"), str(RAW_PORT), str(nbytes))
        seconds = float(sink.stdout.readline())
        sink.wait(30)
    finally:
        if sink.poll() is None:
            sink.kill()
    return nbytes * 8 / seconds / 1e9


def _sink(port: int, nbytes: int) -> None:
    import socket
    import time

    with socket.create_server(("0.0.0.0", port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        buf = memoryview(bytearray(1 << 20))
        got = conn.recv_into(buf)
        t0 = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                raise RuntimeError(f"stream ended after {got} of {nbytes} bytes")
            got += n
        print(time.perf_counter() - t0, flush=True)
        conn.close()


def _source(host: str, port: int, nbytes: int) -> None:
    import socket

    chunk = bytes(1 << 20)
    with socket.create_connection((host, port)) as conn:
        sent = 0
        while sent < nbytes:
            conn.sendall(chunk[: min(len(chunk), nbytes - sent)])
            sent += min(len(chunk), nbytes - sent)


if __name__ == "__main__":  # the two ends of raw_throughput_gbps, each run inside its namespace
    import sys

    if sys.argv[1] == "sink":
        _sink(int(sys.argv[2]), int(sys.argv[3]))
    else:
        _source(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
