"""`pdserve up`: the whole stack on one machine — nats-server and redis-server (unless URLs are given),
the gateway and the workers as separate processes — ready when the gateway's /ready says so.

With `ha` the private servers are replicated instead (replicated.py): a 3-node nats-server cluster whose
streams have 3 replicas, and a Redis primary with a replica under 3 Sentinels, through which the services find
the primary.

The private nats-server and redis-server require passwords generated here, as is the cluster secret that
signs KV pull tickets; every service gets them, and the server URLs, in its environment (never on a command
line, which any local user can read). With `kv_tls` the workers' KV transfer gRPC speaks mutual TLS, with
certificates generated in the run directory (kv_certs.py) or the user's own.

The tests start stacks through the same class, so what they exercise is what users run.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.local.children import popen_options
from services.local.hosts import INFRA, ServiceHosts
from services.local.infra import ServerProcess, free_port, start_nats, start_redis
from services.local.kv_certs import KV_TLS_DIR, KvTlsFiles, dialled_hosts, generate, refuse_other_kv_tls, without_kv_tls
from services.local.proc_cpu import cpu_seconds
from services.local.replicated import (
    NatsCluster,
    RedisSentinels,
    create_streams,
    start_nats_cluster,
    start_redis_sentinels,
)
from services.local.worker_roles import role_served
from shared.engine.config import EngineConfig
from shared.sharding.layout import ParallelLayout
from shared.urls import split_credentials, with_credentials

ROLE_READ_TIMEOUT_S = 0.5  # a worker's /metrics is its own thread's: it answers at once unless the host is swamped


@dataclass(frozen=True)
class StackSpec:
    model: str
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    mixed: int = 0
    nats_url: str | None = None  # None = start a private nats-server on a free port
    redis_url: str | None = None
    threads_per_worker: int | None = None
    # Per-role overrides, keyed "prefill" / "decode" / "mixed" (benchmarks that compare topologies on the same
    # cores): threads replaces threads_per_worker for that role's workers; cpu_affinity pins each of that
    # role's worker processes to those CPU ids (os.sched_setaffinity right after spawn, before the worker
    # starts any thread, so its torch threads inherit it; Linux only). Gateway and infra are never pinned.
    threads: dict[str, int] = field(default_factory=dict)
    cpu_affinity: dict[str, tuple[int, ...]] = field(default_factory=dict)
    host: str = "127.0.0.1"
    worker_args: tuple[str, ...] = ()  # extra flags for every worker
    # Extra flags for one role's workers, after worker_args (so they win): e.g. a KV budget per role, as decode
    # workers hold KV long and prefill workers need activation room: {"decode": ("--kv-cache-bytes", "2147483648")}.
    # A worker that switched role keeps its launch role's (as its engine does), restarts included: Stack.role_of.
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Devices per role ("cpu", "cuda", "cuda:N"; a bare N means cuda:N): worker i of the role runs on
    # devices[i % len(devices)], so fewer devices than workers share them. See worker_devices.
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Worker groups per role: role → (tp, ep); each worker of the role is a group of max(tp, ep) ranks (its
    # process spawns the others: shared/parallel/group_engine.py). On CUDA a group's ranks take consecutive
    # GPUs from the worker's device (worker i of the role starts at devices[i * ranks % len(devices)]); on CPU
    # they split the worker's threads and its pinned cores between them.
    parallel: dict[str, tuple[int, int]] = field(default_factory=dict)
    gateway_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    trace_file: str | None = None  # every service appends its spans to this JSON-lines file
    # Mutual TLS on the KV transfer gRPC of every prefill and decode worker: True = a CA and certificate
    # generated at launch in <log dir>/kv-tls (kv_certs.generate); files = the user's own; False = the
    # workers' own settings apply (PDSERVE_KV_TLS_* inherited, if any).
    kv_tls: bool | KvTlsFiles = False
    # The SLO planner (services/planner) beside the gateway: it switches the workers' roles to keep the SLOs and
    # serves /plan and /metrics on planner_port (0: a free one); planner_args are its extra flags.
    planner: bool = False
    planner_port: int = 0
    planner_args: tuple[str, ...] = ()
    # Each service on a host of its own (services/local/hosts.py): the address it binds and is reached at, the
    # prefix that starts it there, its ports. None: all on this machine (infra on 127.0.0.1, the rest on host).
    # Only with private servers: one given by URL is wherever that URL says.
    hosts: ServiceHosts | None = None
    # The private servers replicated (replicated.py): a 3-node NATS cluster with streams at 3 replicas, and Redis
    # with a replica under 3 Sentinels, all on this machine's loopback. A server given by URL is used as it is.
    ha: bool = False

    def __post_init__(self) -> None:
        if self.mixed < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts must be non-negative")
        if self.mixed == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError("need at least one prefill and one decode worker, or --mixed workers")
        if self.ha and self.hosts is not None:
            raise ValueError("ha: the replicated servers run on this machine's loopback, not on separate hosts (yet)")
        for name, per_role in (
            ("threads", self.threads),
            ("cpu_affinity", self.cpu_affinity),
            ("role_args", self.role_args),
            ("devices", self.devices),
            ("parallel", self.parallel),
        ):
            if unknown := set(per_role) - {"prefill", "decode", "mixed"}:
                raise ValueError(f"{name}: unknown roles {sorted(unknown)} (prefill, decode, mixed)")
        if self.kv_tls:  # the stack sets the workers' KV TLS files: the same settings another way are refused
            flags = [f for role in ("prefill", "decode", "mixed") for f in self.worker_flags_of(role)]
            refuse_other_kv_tls(self.env, flags, own_files=isinstance(self.kv_tls, KvTlsFiles))
        for tp, ep in self.parallel.values():
            ParallelLayout(tp, ep)  # a LayoutError (ValueError) names what to change
        for role, devices in self.devices.items():
            if not devices:
                raise ValueError(f"devices[{role!r}]: name at least one device")
            object.__setattr__(self, "devices", self.devices | {role: tuple(map(device_name, devices))})
        if self.cpu_affinity:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("cpu_affinity needs os.sched_setaffinity (Linux)")
            have = os.sched_getaffinity(0)
            for role, cpus in self.cpu_affinity.items():
                if not cpus or not set(cpus) <= have:
                    raise ValueError(
                        f"cpu_affinity[{role!r}] = {tuple(cpus)}: not a non-empty subset of the CPUs this "
                        f"process may use, {sorted(have)} ({os.cpu_count()} cores on this machine)"
                    )

    def worker_flags_of(self, role: str) -> list[str]:
        """The flags every worker of `role` gets from the spec (worker_args, then the role's own)."""
        return [*self.worker_args, *self.role_args.get(role, ())]

    def roles(self) -> list[str]:
        """The role of every worker, in start order."""
        return ["mixed"] * self.mixed if self.mixed else ["prefill"] * self.prefill + ["decode"] * self.decode

    def ranks(self, role: str) -> int:
        """Processes per worker of `role`: its group's size (1 without tp/ep)."""
        return max(self.parallel.get(role, (1, 1)))

    def worker_devices(self) -> list[str | None]:
        """The device of every worker (in roles() order); None where its role has no devices (the worker's own
        setting applies)."""
        seen: dict[str, int] = {}
        out: list[str | None] = []
        for role in self.roles():
            i = seen[role] = seen.get(role, -1) + 1
            devices = self.devices.get(role)
            out.append(devices[i * self.ranks(role) % len(devices)] if devices else None)
        return out

    def shared_gpus(self) -> dict[str, int]:
        """CUDA devices given to more than one worker → how many workers share each."""
        counts: dict[str, int] = {}
        for d in self.worker_devices():
            if d is not None and d.startswith("cuda"):
                counts[d] = counts.get(d, 0) + 1
        return {d: n for d, n in counts.items() if n > 1}

    def nccl_pairs(self) -> bool:
        """Whether every prefill and decode worker is on a CUDA device and no prefill worker shares a GPU with
        a decode worker: then KV can move over NCCL (it refuses two ranks of a pair on one GPU)."""
        placed = list(zip(self.roles(), self.worker_devices(), strict=True))
        if self.mixed or any(d is None or not d.startswith("cuda") for _, d in placed):
            return False
        prefill = {d for r, d in placed if r == "prefill"}
        return not prefill & {d for r, d in placed if r == "decode"}


@dataclass(frozen=True)
class Replacement:
    """A worker's new process, started by `Stack.start_replacement`: what `swap_in` registers."""

    name: str
    proc: subprocess.Popen
    args: list[str]
    env: dict[str, str] | None
    metrics_port: int


def device_name(spec: str) -> str:
    """A device as a worker's --device takes it: "cpu", "cuda", "cuda:N"; a bare N is cuda:N."""
    spec = spec.strip()
    if spec.isdigit():
        return f"cuda:{spec}"
    kind, _, index = spec.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return spec
    raise ValueError(f"unknown device {spec!r}: cpu, cuda, cuda:N or a GPU index N")


class Stack:
    def __init__(self, spec: StackSpec, log_dir: str | None = None, quiet: bool = True) -> None:
        self.spec = spec
        self.quiet = quiet
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.infra: list[ServerProcess] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_files: list = []
        # URLs a client of this stack's servers can use as they are (credentials included): tests and tools. A
        # NATS cluster's is its nodes' URLs, comma-separated; redis_url follows the Sentinels' primary (ha).
        self.nats_url = spec.nats_url
        self._redis_url = spec.redis_url
        self.nats_cluster: NatsCluster | None = None  # spec.ha: the private NATS cluster
        self.redis_sentinels: RedisSentinels | None = None  # spec.ha: the private Redis primary, replica, Sentinels
        # The private servers' settings, for every service (see service_env).
        self._infra_env: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}  # worker name → its /metrics port
        self.planner_port: int | None = None  # the planner's /plan and /metrics, with spec.planner
        self._spawned: dict[str, tuple[list[str], dict[str, str] | None]] = {}  # name → spawn()'s arguments
        # Signs KV pull tickets between this stack's workers; one given in the environment wins.
        self.cluster_secret = secrets.token_urlsafe(32)
        # The KV transfer TLS files every prefill and decode worker gets (spec.kv_tls), set at launch.
        self.kv_tls: KvTlsFiles | None = None
        self._placement: dict[str, tuple[str, str | None]] = {}  # worker name → the role it was launched as, device
        # worker name → the role it serves now: its launch role until the supervisor reads another (a switch,
        # worker_roles.py); a restart starts it in this role, with its launch role's flags, device and cores
        self._serving: dict[str, str] = {}
        self._generation: dict[str, int] = {}  # worker name → replacements started for it (rolling restarts)
        # Processes of a worker hand-over (rolling.py), outside `procs`: a replacement not serving yet, a replaced
        # worker draining. stop() stops them too.
        self.handover: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://{self.address('gateway')}:{self.spec.port}"

    def address(self, service: str) -> str:
        """Where `service` ("nats", "redis", "gateway", a worker's name) listens: its host's address with
        spec.hosts; else 127.0.0.1 for the private servers and spec.host for the rest."""
        if self.spec.hosts is not None:
            return self.spec.hosts.address(service)
        return "127.0.0.1" if service in INFRA else self.spec.host

    def _prefix(self, service: str) -> list[str]:
        return self.spec.hosts.prefix(service) if self.spec.hosts is not None else []

    def _port(self, service: str) -> int | None:
        """A port free on `service`'s host with spec.hosts; None without (a free one here is the caller's pick)."""
        return self.spec.hosts.port(service) if self.spec.hosts is not None else None

    @property
    def redis_url(self) -> str | None:
        """The Redis URL, credentials included; with private Sentinels, that of the primary they name now."""
        plane = self.redis_sentinels
        if plane is None or (primary := plane.primary()) is None:
            return self._redis_url
        return with_credentials(f"redis://{primary.host}:{primary.port}/0", None, plane.password)

    def start(self, ready_timeout_s: float = 120.0) -> Stack:
        """launch(), then wait_ready(): a stack that serves, or an error (and everything it started stopped)."""
        self.launch()
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        """Start the private servers, the workers and the gateway, without waiting for them to be ready (the
        supervisor waits its own way). Stops what it started if any start fails."""
        try:
            self.prepare_kv_tls()
            if self.nats_url is None:
                self._start_nats()
            if self._redis_url is None:
                self._start_redis()
            spec = self.spec
            for i, (role, device) in enumerate(zip(spec.roles(), spec.worker_devices(), strict=True)):
                name = f"{role}-{i}"
                self._placement[name] = (role, device)
                self._serving[name] = role
                args, self.metrics_ports[name] = self._worker_args(name)
                self.spawn(name, args, env=self.worker_env())
            self.spawn("gateway", ["gateway", "--port", str(self.spec.port), "--host", self.address("gateway"),
                                   *self._common_flags(), *self.spec.gateway_args])  # fmt: skip
            if spec.planner:
                self.planner_port = spec.planner_port or free_port(spec.host)
                self.spawn("planner", ["planner", "--port", str(self.planner_port), "--host", spec.host,
                                       *self._common_flags(), *spec.planner_args])  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _start_nats(self) -> None:
        """The private nats-server (or, with spec.ha, cluster: its streams made at its size), and its settings."""
        user, password = "pdserve", secrets.token_urlsafe(24)
        if self.spec.ha:
            cluster = self.nats_cluster = start_nats_cluster(user, password)
            self.infra += cluster.nodes
            replicas = len(cluster.nodes)
            create_streams(cluster.url, replicas)
            self.nats_url, bare = cluster.url, cluster.bare_url
        else:
            self.infra.append(start_nats(self._port("nats"), self.address("nats"), user, password,
                                         prefix=self._prefix("nats")))  # fmt: skip
            replicas = 1
            self.nats_url = self.infra[-1].url
            bare = split_credentials(self.nats_url)[0]
        self._infra_env |= {"PDSERVE_NATS_URL": bare, "PDSERVE_NATS_USER": user, "PDSERVE_NATS_PASSWORD": password,
                            "PDSERVE_JETSTREAM_REPLICAS": str(replicas)}  # fmt: skip

    def _start_redis(self) -> None:
        """The private redis-server (or, with spec.ha, primary, replica and Sentinels), and its settings."""
        password = secrets.token_urlsafe(24)
        if self.spec.ha:
            plane = self.redis_sentinels = start_redis_sentinels(password)
            self.infra += plane.servers
            self._redis_url = plane.nodes[0].url
            self._infra_env |= {"PDSERVE_REDIS_SENTINELS": plane.addresses,
                                "PDSERVE_REDIS_SENTINEL_MASTER": plane.master}  # fmt: skip
        else:
            self.infra.append(start_redis(self._port("redis"), self.address("redis"), password,
                                          prefix=self._prefix("redis")))  # fmt: skip
            self._redis_url = self.infra[-1].url
        bare = split_credentials(self._redis_url)[0]
        self._infra_env |= {"PDSERVE_REDIS_URL": bare, "PDSERVE_REDIS_PASSWORD": password}

    def _worker_args(self, name: str, generation: int = 0) -> tuple[list[str], int]:
        """The command line of worker `name` — `<role it serves now> <flags>` — and the /metrics port it names (a free
        one). Its worker id is "<name>-<launcher pid>", and "-<generation>" for a rolling restart's replacement, which
        runs beside the worker it replaces for a while: ids, own queues and /metrics ports must differ. The flags are
        its launch role's (see `role_of`)."""
        launched, device = self._placement[name]
        port = self._port(name) or free_port(self.address(name))
        worker_id = f"{name}-{os.getpid()}" + (f"-{generation}" if generation else "")
        flags = ["--worker-id", worker_id, "--metrics-port", str(port), "--metrics-host", self.address(name)]
        if self.spec.hosts is not None:  # the KV transfer server binds, and advertises, its host's address
            flags += ["--rpc-host", self.address(name)]
        return [self._serving[name], *flags, *self._worker_flags(launched, device)], port

    def role_of(self, name: str) -> str | None:
        """The role worker `name` serves now, as last read (`refresh_roles`); None for the gateway (or a name this
        stack never started). A switched worker keeps its name (and worker id: it names the slot, not the role) and
        what it was launched with — its launch role's flags (role_args: the KV budget, threads, group layout), device
        and pinned cores — as a live switch keeps its engine: a restart changes nothing but the role, and never takes
        another role's devices or cores, which that role's own workers hold."""
        return self._serving.get(name)

    def refresh_roles(self, names: Iterable[str] | None = None) -> dict[str, tuple[str, str]]:
        """Read the role of each running worker of `names` (default: every worker in `procs`) and keep it for its
        next restart; a worker that does not answer keeps the role last read. Returns the changes: name → (the role
        it had, the role it serves now)."""
        changed = {}
        for name in [n for n in self.procs if n in self._serving] if names is None else names:
            if self.procs[name].poll() is not None:
                continue
            role = self.read_role(name)
            if role is not None and role != self._serving[name]:
                changed[name] = (self._serving[name], role)
                self._serving[name] = role
        return changed

    def read_role(self, name: str) -> str | None:
        """One look at the role worker `name`'s process serves, from its /metrics (worker_roles.py); None when it
        does not answer or serves none yet."""
        url = f"http://{self.address(name)}:{self.metrics_ports[name]}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=ROLE_READ_TIMEOUT_S) as resp:
                return role_served(resp.read().decode(errors="replace"))
        except (OSError, ValueError):  # no answer; or a text the parser refuses (not a worker's)
            return None

    def start_replacement(self, name: str) -> Replacement:
        """A new process for worker `name` — in the role it serves now (`role_of`), with its device and flags, a new
        worker id and /metrics port —
        started now but not in `procs` (a supervisor does not restart it) until `swap_in`; in `handover` till then."""
        generation = self._generation[name] = self._generation.get(name, 0) + 1
        args, port = self._worker_args(name, generation)
        env = self.worker_env()
        proc = self._start(name, args, env)
        self.handover.append(proc)
        return Replacement(name, proc, args, env, port)

    def swap_in(self, replacement: Replacement) -> None:
        """`replacement` becomes its worker's process in `procs` (a respawn starts it as it was started); the
        name must have been retired."""
        name = replacement.name
        if name in self.procs:
            raise RuntimeError(f"{name} is still in the stack: retire it first")
        self.handover.remove(replacement.proc)
        self.procs[name] = replacement.proc
        self._spawned[name] = (replacement.args, replacement.env)
        self.metrics_ports[name] = replacement.metrics_port

    def retire(self, name: str) -> subprocess.Popen:
        """Take worker `name`'s process out of `procs` (no supervisor restarts it once it exits) into `handover`;
        the caller stops it."""
        proc = self.procs.pop(name)
        self.handover.append(proc)
        return proc

    def beats(self, name: str, metrics_port: int) -> bool:
        """Whether worker `name`'s process serving /metrics on `metrics_port` has sent its first heartbeat: each
        beat sets its load gauges (shared/worker/gauges.py), which its /metrics shows from then on. The gateways
        have the beat then: they count the worker live and route to it."""
        url = f"http://{self.address(name)}:{metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return b"pdserve:num_requests_running{" in resp.read()
        except OSError:
            return False

    def prepare_kv_tls(self) -> None:
        """The files of spec.kv_tls: generated afresh in the run directory (kept with the logs; the CA's key is
        deleted once it has signed), or the user's. Generated ones name every host a decode worker may dial,
        with spec.hosts every worker's address too."""
        if self.spec.kv_tls is True:
            hosts = dialled_hosts(os.environ | self.spec.env, self.spec.worker_flags_of("prefill"))
            if self.spec.hosts is not None:
                hosts += [self.address(f"{role}-{i}") for i, role in enumerate(self.spec.roles())]
            self.kv_tls = generate(self.log_dir / KV_TLS_DIR, list(dict.fromkeys(hosts)))
        elif isinstance(self.spec.kv_tls, KvTlsFiles):
            self.kv_tls = self.spec.kv_tls

    def worker_env(self) -> dict[str, str]:
        """What a worker's environment has beyond service_env(): the KV transfer TLS files, with spec.kv_tls."""
        return self.kv_tls.env() if self.kv_tls is not None else {}

    def _common_flags(self) -> list[str]:
        flags = ["--model", self.spec.model]
        if self.spec.trace_file:
            flags += ["--trace-file", str(Path(self.spec.trace_file).resolve())]
        return flags

    def metrics_urls(self) -> list[str]:
        """The /metrics URL of every worker (the gateway's is at url + "/metrics")."""
        return [f"http://{self.address(name)}:{port}/metrics" for name, port in self.metrics_ports.items()]

    def _worker_flags(self, role: str, device: str | None = None) -> list[str]:
        """Flags of one worker: common ones, the device placement's (before the user's, which win), the user's
        worker_args and role_args, threads."""
        flags = self._common_flags()
        if device is not None:
            flags += ["--device", device] + self._placement_flags(role, device)
        flags += list(self.spec.worker_args) + list(self.spec.role_args.get(role, ()))
        if threads := self.spec.threads.get(role, self.spec.threads_per_worker):
            flags += ["--threads", str(threads)]
        if role in self.spec.parallel:  # a group: its ranks split these threads (and pinned cores) between them
            tp, ep = self.spec.parallel[role]
            flags += ["--tp", str(tp), "--ep", str(ep)]
        return flags

    def _placement_flags(self, role: str, device: str) -> list[str]:
        """What a device placement implies unless the user said otherwise: workers sharing a GPU split the
        default gpu_memory_utilization (each engine's share is its own budget: together they would ask for
        k x 0.9 of it), and prefill/decode workers on disjoint GPUs move KV over NCCL."""
        given = " ".join([*self.spec.worker_args, *self.spec.role_args.get(role, ())])
        env = self.service_env()
        flags = []
        sharing = self.spec.shared_gpus().get(device, 1)
        budget_given = any(f in given for f in ("--gpu-memory-utilization", "--kv-cache-bytes", "--num-kv-blocks"))
        budget_given |= any(f"PDSERVE_{v}" in env for v in ("GPU_MEMORY_UTILIZATION", "KV_CACHE_BYTES"))
        if sharing > 1 and not budget_given:
            share = EngineConfig.__dataclass_fields__["gpu_memory_utilization"].default
            flags += ["--gpu-memory-utilization", f"{share / sharing:.4f}"]
        if self.spec.nccl_pairs() and "--transfer-backend" not in given and "PDSERVE_TRANSFER_BACKEND" not in env:
            flags += ["--transfer-backend", "nccl"]
        return flags

    def service_env(self) -> dict[str, str]:
        """The environment of every service: this process's, with the stack's servers and secrets.

        A cluster secret already in the environment wins (several stacks may share workers). For a server
        this stack started, its URL and credentials replace any PDSERVE_NATS_* / PDSERVE_REDIS_* inherited
        (they were meant for another server); for a server given by URL, the inherited ones apply to it. With
        spec.kv_tls, inherited PDSERVE_KV_TLS_* are dropped (worker_env sets the stack's; a server name stays
        with the user's own files). spec.env wins over everything."""
        inherited = dict(os.environ)
        for plane in ("NATS", "REDIS"):
            if f"PDSERVE_{plane}_URL" in self._infra_env:
                inherited = {k: v for k, v in inherited.items() if not k.startswith(f"PDSERVE_{plane}_")}
        if self.spec.kv_tls:  # the stack's KV TLS files (worker_env) replace inherited ones
            inherited = without_kv_tls(inherited, own_files=isinstance(self.spec.kv_tls, KvTlsFiles))
        given = {"PDSERVE_NATS_URL": self.spec.nats_url, "PDSERVE_REDIS_URL": self.spec.redis_url}
        # a secret file of the user's names the cluster's secret: ours would hide it (the variable wins the file)
        own_secret = {"PDSERVE_CLUSTER_SECRET": self.cluster_secret}
        if "PDSERVE_CLUSTER_SECRET_FILE" in inherited or "PDSERVE_CLUSTER_SECRET_FILE" in self.spec.env:
            own_secret = {}
        return (
            own_secret
            | inherited
            | {k: v for k, v in given.items() if v is not None}
            | self._infra_env
            | {"PYTHONUNBUFFERED": "1"}
            | self.spec.env
        )

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `pdserve <args>` as a child named `name` (logs in log_path(name) unless not quiet), with
        service_env() and then `env`; a worker of a role in spec.cpu_affinity is pinned to its CPUs. The child
        has its own process group and stops when this process dies (children.popen_options)."""
        self._spawned[name] = (args, env)
        self.procs[name] = proc = self._start(name, args, env)
        return proc

    def _start(self, name: str, args: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        """The process of `spawn`, not registered anywhere."""
        path = self.log_path(name)  # None exactly when not quiet
        out = open(path, "ab") if path is not None else None  # closed in stop()
        if out is not None:
            self._log_files.append(out)
        env = self.service_env() | (env or {})
        argv = [*self._prefix(name), sys.executable, "-m", "services.cli", *args]
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT
                                if out else None, env=env, **popen_options())  # fmt: skip
        placed = self._placement.get(name)  # a worker's cores are its launch role's, whatever it serves now
        role = placed[0] if placed is not None else args[0]
        if role in self.spec.cpu_affinity:  # before the interpreter has started any thread
            os.sched_setaffinity(proc.pid, self.spec.cpu_affinity[role])
        return proc

    def log_path(self, name: str) -> Path | None:
        """Where service `name` writes its output; None when it goes to this process's own (not quiet)."""
        return self.log_dir / f"{name}.log" if self.quiet else None

    def respawn(self, name: str) -> subprocess.Popen:
        """Start service `name` again as it was last started (after it died or was killed): the same command line,
        worker id and ports; a worker in the role it serves now (`role_of`: it may have switched)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        args, env = self._spawned[name]
        if (role := self.role_of(name)) is not None:  # a worker's command line is `<role> <flags>` (_worker_args)
            args = [role, *args[1:]]
        return self.spawn(name, args, env)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the stack is ready (probe_ready); raises if a service exits or time runs out first."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.log_dir}/{name}.log")
            ready, last = self.probe_ready()
            if ready:
                return
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready after {timeout_s}s: {last}; logs in {self.log_dir}")

    def probe_ready(self) -> tuple[bool, str]:
        """One look: whether the gateway's /ready answers 200 and every worker this stack started serves its
        /metrics (a worker does once it is connected: /ready needs only one worker of each role, and a stack
        is ready when all it started can take work); what is missing otherwise."""
        gateway, why = _answers(f"{self.url}/ready")
        if not gateway:
            return False, why
        waiting = [
            n for n, port in self.metrics_ports.items() if not _answers(f"http://{self.address(n)}:{port}/metrics")[0]
        ]
        return (False, f"waiting for {', '.join(waiting)} to connect") if waiting else (True, "HTTP 200")

    def stop(self, timeout_s: float = 15.0, abort: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM to every service (they drain), SIGKILL to those still running after `timeout_s` or as soon
        as `abort()` says so (a second signal to the supervisor); then the private servers stop. The processes of
        a hand-over in progress (`handover`) are stopped with them."""
        services = list(self.procs.items()) + [(f"a worker of a hand-over (pid {p.pid})", p) for p in self.handover]
        for _, proc in services:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for _, p in services) and time.monotonic() < deadline and not abort():
            time.sleep(0.05)
        for name, proc in services:
            if proc.poll() is None:
                why = "at once (asked to)" if abort() else f"after {timeout_s}s of draining"
                print(f"pdserve: {name} still running {why}; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()
        self.handover.clear()
        for server in reversed(self.infra):
            server.stop()
        self.infra.clear()
        for f in self._log_files:
            f.close()
        self._log_files.clear()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far (utime + stime) of each process this stack started: its services by name, its private
        NATS and Redis servers by theirs; 0 for one that is gone."""
        out = {name: cpu_seconds(proc.pid) for name, proc in self.procs.items()}
        return out | {s.name: cpu_seconds(s.proc.pid) for s in self.infra if s.proc is not None}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.log_dir.glob("*.log"))


def _answers(url: str) -> tuple[bool, str]:
    """One GET: whether it answered 200, and what it said otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace")[:200]
    except OSError as exc:
        return False, str(exc)
