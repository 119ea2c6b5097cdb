"""An emulated link between two machines on one host: two network namespaces joined by a veth pair, its rate
capped by a token-bucket qdisc (`tc ... tbf`) on both ends.

    with VethLink.create() as link:          # pdbench-<pid>-p and pdbench-<pid>-d, 10.213.0.1 ↔ 10.213.0.2
        link.cap(10)                          # 10 Gb/s each way; link.cap(None): uncapped
        subprocess.run([*link.exec_in("p"), "python", ...])

Only the rate is emulated: `tbf` works here, `netem` (added delay, loss) does not, so the link has loopback-like
latency. Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not, for a caller to skip with a message.

Nothing stays behind: the veth pair is created inside the two namespaces (never in the host's), so deleting
them removes everything; `close()` runs on exit from the `with` block, and `terminate_on_signals()` turns
SIGTERM/SIGHUP into SystemExit so that exit happens on those too (SIGINT already raises KeyboardInterrupt).
A SIGKILL leaves the namespaces, named after the dead pid: `sweep_stale()`, run by `create()`, removes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "pdbench-"
_OURS = re.compile(rf"^{PREFIX}(\d+)-[pd]$")
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
            ns, dev = self.netns(side), self.device(side)
            if gbit is None:
                with contextlib.suppress(RuntimeError):  # no qdisc of ours there: nothing to remove
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
                continue
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{gbit}gbit", "burst", str(tbf_burst_bytes(gbit)), "latency", TBF_LATENCY)  # fmt: skip

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
