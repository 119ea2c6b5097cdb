"""The replicated control plane `pdserve up --ha` starts instead of one nats-server and one redis-server: a
nats-server cluster (JetStream on every node, each with its own store) and a Redis primary with a replica under
three Sentinels. Every server gets loopback ports of its own and the passwords the single servers would have
(infra.py); the cluster's routes log in with a password of their own.

Restarting a node (the supervisor does, through ServerProcess.restart):
  - a NATS node comes back on its ports with its store and rejoins the cluster: the streams' replicas it held
    catch up from their leaders;
  - a Redis node comes back as a replica of the primary the Sentinels name, after they have promoted another if
    it was the primary itself (SentinelledRedis.restart). A primary restarted empty before the Sentinels noticed
    its death would stay the primary, and the replica would copy its emptiness: the failover would not happen.

Nothing is persisted by Redis: after a failover the KV locations the old primary had not yet replicated are gone
(replication is asynchronous), which costs the requests they belonged to a recompute (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from redis import Redis

from services.local.infra import ServerProcess, _quoted, _start, find_binary, free_port, start_nats, start_redis
from shared import bus
from shared.urls import split_credentials

NATS_NODES = 3
SENTINELS = 3
SENTINEL_QUORUM = 2  # Sentinels that must agree the primary is down before one of them fails it over
SENTINEL_MASTER = "pdserve"  # what the Sentinels call the primary (settings.redis_sentinel_master's default)
# The primary is down for a Sentinel once it has not answered for this long. Short on one host (loopback, no
# network to blame for a late PING); compose, across containers, waits longer (compose.yaml).
DOWN_AFTER_MS = 2000
FAILOVER_TIMEOUT_MS = 10_000  # a failover that has not completed by then is tried again (by another Sentinel)
READY_TIMEOUT_S = 30.0  # for the cluster's streams, or the Sentinels to know each other and the replica
PRIMARY_WAIT_S = 15.0  # how long a restarting primary waits for the Sentinels to promote its replica


@dataclass
class NatsCluster:
    """The nodes of a nats-server cluster, and where each one's monitoring endpoint answers (/healthz, /jsz)."""

    nodes: list[ServerProcess]
    monitor_urls: dict[str, str]  # node name → http://host:port

    @property
    def url(self) -> str:
        """Every node's URL, with the client credentials, comma-separated (settings.nats_url takes such a list)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def bare_url(self) -> str:
        """The same without credentials."""
        return ",".join(split_credentials(node.url)[0] for node in self.nodes)


def start_nats_cluster(
    user: str, password: str, nodes: int = NATS_NODES, host: str = "127.0.0.1", name: str = "pdserve"
) -> NatsCluster:
    """`nodes` nats-servers named nats-0..n-1, routed to each other as cluster `name`, each with JetStream in its own
    store directory and clients logging in as `user` (infra.start_nats). Returns once each listens (JetStream may
    still be electing its meta leader: create_streams waits for it). Stops what it started if one fails."""
    route_user, route_password = "route", secrets.token_urlsafe(24)  # URL-safe: it goes into the route URLs
    route_ports = [free_port(host) for _ in range(nodes)]
    routes = ", ".join(_quoted(f"nats-route://{route_user}:{route_password}@{host}:{p}") for p in route_ports)
    cluster = NatsCluster([], {})
    try:
        for i, route_port in enumerate(route_ports):
            node, monitor = f"nats-{i}", free_port(host)
            conf = [
                f"server_name: {_quoted(node)}",
                f"http: {_quoted(f'{host}:{monitor}')}",
                f"cluster {{ name: {_quoted(name)}, listen: {_quoted(f'{host}:{route_port}')}, "
                f"authorization {{ user: {_quoted(route_user)}, password: {_quoted(route_password)} }}, "
                f"routes: [{routes}] }}",
            ]
            cluster.nodes.append(start_nats(host=host, user=user, password=password, name=node, extra_conf=conf))
            cluster.monitor_urls[node] = f"http://{host}:{monitor}"
    except BaseException:
        for server in cluster.nodes:
            server.stop()
        raise
    return cluster


def create_streams(url: str, replicas: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Create the services' streams at `replicas` through `url` (comma-separated, with credentials), retrying
    while the cluster elects its JetStream meta leader; TimeoutError with the last error after `timeout_s`."""

    async def create() -> None:
        nc = await nats.connect(url.split(","), connect_timeout=2)
        try:
            deadline, last = time.monotonic() + timeout_s, ""
            while time.monotonic() < deadline:
                try:
                    await bus.ensure_streams(nc.jetstream(timeout=2), replicas)
                    return
                except Exception as exc:  # JetStream not ready: no meta leader yet, or too few nodes known
                    last = f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(0.2)
            raise TimeoutError(f"the JetStream streams could not be made at {replicas} replicas: {last}")
        finally:
            await nc.close()

    asyncio.run(create())


@dataclass
class SentinelledRedis(ServerProcess):
    """A Redis node the Sentinels on `sentinel_ports` watch: restarted as a replica of the primary they name."""

    sentinel_ports: tuple[int, ...] = ()
    password: str | None = field(default=None, repr=False)
    master: str = SENTINEL_MASTER

    def restart(self, kill: bool = False, down_s: float = 0.0) -> None:
        """As ServerProcess.restart, but first point its configuration at the primary the Sentinels name, waiting
        up to PRIMARY_WAIT_S for them to name another when they still name this node (it was the primary)."""
        self._end(kill)
        if down_s > 0:
            time.sleep(down_s)
        deadline = time.monotonic() + PRIMARY_WAIT_S
        primary = self._primary()
        while primary == (self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
            primary = self._primary()
        self._follow(None if primary == (self.host, self.port) else primary)
        self._launch()

    def _primary(self) -> tuple[str, int] | None:
        return sentinel_primary(self.host, self.sentinel_ports, self.password, self.master)

    def _follow(self, primary: tuple[str, int] | None) -> None:
        """Its configuration file, made to replicate `primary` (None: to be a primary)."""
        conf = Path(self.cmd[-1])  # its configuration file, the command's last word
        lines = [line for line in conf.read_text().splitlines() if not line.startswith("replicaof ")]
        if primary is not None:
            lines.append(f"replicaof {primary[0]} {primary[1]}")
        conf.write_text("\n".join(lines) + "\n")


@dataclass
class RedisSentinels:
    """A Redis primary and replica (redis-0, redis-1 at start; they may swap) and the Sentinels watching them."""

    nodes: list[SentinelledRedis]
    sentinels: list[ServerProcess]
    password: str | None = field(default=None, repr=False)
    master: str = SENTINEL_MASTER

    @property
    def servers(self) -> list[ServerProcess]:
        return [*self.nodes, *self.sentinels]

    @property
    def addresses(self) -> str:
        """The Sentinels as settings.redis_sentinels takes them: host:port, comma-separated."""
        return ",".join(f"{s.host}:{s.port}" for s in self.sentinels)

    def primary(self) -> SentinelledRedis | None:
        """The node the Sentinels name as primary now (None: none answered)."""
        host = self.sentinels[0].host
        address = sentinel_primary(host, tuple(s.port for s in self.sentinels), self.password, self.master)
        return next((n for n in self.nodes if (n.host, n.port) == address), None)


def start_redis_sentinels(
    password: str | None, host: str = "127.0.0.1", sentinels: int = SENTINELS, down_after_ms: int = DOWN_AFTER_MS
) -> RedisSentinels:
    """redis-0 (primary) and redis-1 (its replica), then `sentinels` Sentinels watching them; returns once the
    replica is in sync and every Sentinel knows the replica and the other Sentinels (a failover needs both).
    Everything requires `password`, the Sentinels too. Stops what it started if anything fails."""
    auth = [f"masterauth {_quoted(password)}"] if password is not None else []
    quick_sync = ["repl-diskless-sync-delay 0"]  # a replica syncs at once (not after 5 s waiting for others)
    started: list[ServerProcess] = []
    try:
        primary = start_redis(host=host, password=password, name="redis-0", extra_conf=auth + quick_sync)
        started.append(primary)
        replica_conf = [*auth, *quick_sync, f"replicaof {host} {primary.port}"]
        started.append(start_redis(host=host, password=password, name="redis-1", extra_conf=replica_conf))
        watchers = [
            _start_sentinel(f"sentinel-{i}", host, password, primary.port, down_after_ms) for i in range(sentinels)
        ]
        started += watchers
        ports = tuple(s.port for s in watchers)
        nodes = [SentinelledRedis(**vars(n), sentinel_ports=ports, password=password) for n in started[:2]]
        plane = RedisSentinels(nodes, watchers, password)
        _wait_watching(plane)
    except BaseException:
        for server in reversed(started):
            server.stop()
        raise
    return plane


def _start_sentinel(name: str, host: str, password: str | None, primary_port: int, down_after_ms: int) -> ServerProcess:
    """One Sentinel (`redis-server <conf> --sentinel`) watching the primary on `primary_port`. It rewrites its
    configuration as it learns (the other Sentinels, the replica, the current primary): the file lives in its data
    directory, which its restarts keep."""
    port = free_port(host)
    data = tempfile.TemporaryDirectory(prefix=f"pdserve-{name}-")
    conf = [
        f"port {port}",
        f"bind {host}",
        f"dir {_quoted(data.name)}",
        f"sentinel monitor {SENTINEL_MASTER} {host} {primary_port} {SENTINEL_QUORUM}",
        f"sentinel down-after-milliseconds {SENTINEL_MASTER} {down_after_ms}",
        f"sentinel failover-timeout {SENTINEL_MASTER} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {SENTINEL_MASTER} 1",
    ]
    if password is not None:  # the Sentinels log in to Redis and to each other, and require it themselves
        secret = _quoted(password)
        conf += [f"sentinel auth-pass {SENTINEL_MASTER} {secret}", f"sentinel sentinel-pass {secret}",
                 f"requirepass {secret}"]  # fmt: skip
    conf_path = Path(data.name) / "sentinel.conf"
    conf_path.write_text("\n".join(conf) + "\n")
    cmd = [find_binary("redis-server"), str(conf_path), "--sentinel"]
    return _start(name, cmd, data, f"redis://{host}:{port}", host, port)


def _wait_watching(plane: RedisSentinels, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every Sentinel knows the replica (in sync) and the other Sentinels: before that a failover could
    not happen. TimeoutError saying what is missing."""
    deadline, state = time.monotonic() + timeout_s, {}
    others, replicas = len(plane.sentinels) - 1, len(plane.nodes) - 1
    while time.monotonic() < deadline:
        state = {s.name: _sentinel_view(s, plane.password, plane.master) for s in plane.sentinels}
        if all(v is not None and v["num-other-sentinels"] >= others and v["num-slaves"] >= replicas
               for v in state.values()):  # fmt: skip
            return
        time.sleep(0.2)
    raise TimeoutError(f"the Sentinels do not all know each other and the replica after {timeout_s:g} s: {state}")


def _sentinel_view(sentinel: ServerProcess, password: str | None, master: str) -> dict[str, Any] | None:
    """What one Sentinel knows of `master` (SENTINEL MASTER: num-slaves, num-other-sentinels, ...); None if it
    does not answer."""
    with contextlib.closing(Redis(sentinel.host, sentinel.port, password=password, socket_timeout=1.0)) as client:
        try:
            view: Any = client.sentinel_master(master)  # redis-py parses it into a dict
        except Exception:  # not up yet, or not monitoring yet
            return None
    return view


def sentinel_primary(host: str, ports: tuple[int, ...], password: str | None, master: str) -> tuple[str, int] | None:
    """The primary's address as the first Sentinel that answers names it (None: none answered)."""
    for port in ports:
        with contextlib.closing(Redis(host, port, password=password, socket_timeout=1.0)) as client:
            try:
                address: Any = client.sentinel_get_master_addr_by_name(master)  # (host, port), or None
            except Exception:  # this one is down: ask the next
                continue
        if address:
            host_name = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
            return host_name, int(address[1])
    return None
