"""Kubernetes pods of rendered manifests (tests/kustomize.py), run here as processes: each container's command, with
the environment, files and network the pod would give it, as tests/integration/test_compose.py runs compose's.

What a pod would have, and what stands in for it here:
    its own IP and ports          127.0.0.1, each containerPort of each pod mapped to a free local port; a string
                                  naming a Service or a pod's DNS name (`svc:port`, `pod.headless-svc:port`)
                                  becomes 127.0.0.1:<that pod's local port>, a pod's own container port its own
                                  local one (in env values, commands, mounted ConfigMap files, probe commands)
    volumes at their mountPath    a directory per pod and volume (ConfigMap and Secret keys written as files,
                                  emptyDir and volumeClaimTemplates empty), the mountPath in every string
                                  replaced by it, as the image sees it (the image's own scripts too)
    the image's entrypoint        IMAGE_ENTRYPOINTS, run through shims on PATH (`pdserve` is `python -m
                                  services.cli`, as the console script; docker/ scripts as the Dockerfile installs
                                  them); nats-server, redis-server and redis-cli from this machine
    env, envFrom, fieldRef        as the kubelet makes them ($(VAR) expansion included; status.podIP 127.0.0.1)
    probes, preStop, SIGTERM      httpGet / exec / tcpSocket probes against the mapped ports; `stop` runs preStop,
                                  then SIGTERM, and times the exit against terminationGracePeriodSeconds

Deployments start one replica here (their count is the autoscaler's), StatefulSets all of theirs (NATS's
routes need every peer).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.local.infra import free_port

ROOT = Path(__file__).resolve().parents[1]
Object = dict[str, Any]

# What each image runs without `command` (the Dockerfile's ENTRYPOINTs; test_compose.py checks them there).
IMAGE_ENTRYPOINTS = {"pdserve:latest": ["pdserve"], "pdserve-gateway:latest": ["pdserve-gateway"]}
SHIMS = {  # executables of the pdserve images → what runs them here
    "pdserve": f'exec "{sys.executable}" -m services.cli "$@"',
    "pdserve-gateway": f'exec "{sys.executable}" -m services.gateway "$@"',
    "pdserve-healthcheck": f'exec "{sys.executable}" "{ROOT}/docker/healthcheck.py" "$@"',
    "pdserve-secrets-init": f'exec "{sys.executable}" "{ROOT}/docker/secrets_init.py" "$@"',
}
IMAGE_SCRIPTS = {"pdserve-model-init": ROOT / "docker" / "model-init.sh"}  # shell scripts: their paths rewritten too
POD_IP = "127.0.0.1"
NAMESPACE = "default"
_REFERENCE = re.compile(r"\b([a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*):(\d+)\b")
_EXPANSION = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable's value, `$$` a `$`, anything else unchanged."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _EXPANSION.sub(one, value)


def containers_of(spec: Object) -> list[Object]:
    return spec.get("initContainers", []) + spec["containers"]


@dataclass
class Pod:
    name: str
    workload: Object  # the Deployment or StatefulSet
    directory: Path
    ports: dict[int, int] = field(default_factory=dict)  # containerPort → the local port standing in for it
    volumes: dict[str, Path] = field(default_factory=dict)  # volume name → its directory
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # running container name → process

    @property
    def spec(self) -> Object:
        return self.workload["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"]["labels"]

    def container(self, name: str) -> Object:
        return next(c for c in containers_of(self.spec) if c["name"] == name)

    def port(self, container: Object, port: int | str) -> int:
        """A container's port (a number or a port's name) → its local stand-in."""
        if isinstance(port, int):
            return self.ports[port]
        return self.ports[next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)]


class LocalCluster:
    def __init__(self, objects: list[Object], directory: Path) -> None:
        self.objects = objects
        self.directory = directory
        self.pods: list[Pod] = []
        reserved = {p["containerPort"] for o in self._workloads() for c in containers_of(self._spec(o))
                    for p in c.get("ports", [])}  # fmt: skip
        for workload in self._workloads():
            replicas = workload["spec"].get("replicas", 1) if workload["kind"] == "StatefulSet" else 1
            for i in range(replicas):
                name = f"{workload['metadata']['name']}-{i}"
                pod = Pod(name, workload, directory / name)
                for container in containers_of(pod.spec):
                    for p in container.get("ports", []):
                        pod.ports[p["containerPort"]] = self._free_port(reserved)
                self.pods.append(pod)
        for pod in self.pods:
            self._make_volumes(pod)

    # ---- the objects -------------------------------------------------------------------------------------

    def _workloads(self) -> list[Object]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")]

    @staticmethod
    def _spec(workload: Object) -> Object:
        return workload["spec"]["template"]["spec"]

    def find(self, kind: str, name: str) -> Object:
        return next(o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name)

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def pods_of(self, component: str) -> list[Pod]:
        return [p for p in self.pods if p.labels.get("app.kubernetes.io/component") == component]

    @staticmethod
    def _free_port(reserved: set[int]) -> int:
        while (port := free_port()) in reserved:
            pass
        return port

    def _data(self, kind: str, name: str) -> dict[str, bytes]:
        obj = self.find(kind, name)
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
        return {k: v.encode() for k, v in obj.get("data", {}).items()}

    # ---- volumes and the strings that name them ---------------------------------------------------------------

    def _make_volumes(self, pod: Pod) -> None:
        claims = [t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])]
        for volume in pod.spec.get("volumes", []) + [{"name": c, "emptyDir": {}} for c in claims]:
            path = pod.directory / "volumes" / volume["name"]
            path.mkdir(parents=True)
            pod.volumes[volume["name"]] = path
            source = volume.get("configMap") or volume.get("secret")
            if source is None:
                assert "emptyDir" in volume, f"{pod.name}: volume {volume['name']} of a kind not run here"
                continue
            kind, name = ("ConfigMap", source["name"]) if "configMap" in volume else ("Secret", source["secretName"])
            data = self._data(kind, name)
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (path / item["path"]).write_bytes(data[item["key"]])
                (path / item["path"]).chmod(source.get("defaultMode", 0o644))
        for volume in pod.spec.get("volumes", []):  # ConfigMap files are read by the pod: as it would see them
            if "configMap" in volume:
                for f in pod.volumes[volume["name"]].iterdir():
                    f.write_text(self.rewrite(pod, self._mounts_reading(pod, volume["name"]), f.read_text()))

    @staticmethod
    def _mounts_reading(pod: Pod, volume: str) -> Object:
        """A container that mounts `volume` (whose mounts then give the file's paths their meaning)."""
        return next(c for c in containers_of(pod.spec) if any(m["name"] == volume for m in c.get("volumeMounts", [])))

    def rewrite(self, pod: Pod, container: Object, text: str) -> str:
        """`text` as seen from `container` of `pod` run here: other pods' and Services' addresses, its own ports,
        its mount paths (see the module)."""
        text = _REFERENCE.sub(lambda m: self._resolve(m.group(1), int(m.group(2))) or m.group(0), text)
        for port, local in pod.ports.items():
            text = re.sub(rf"(?<![\d.]){port}(?![\d.])", str(local), text)
        for mount in sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            local = pod.volumes[mount["name"]] / mount.get("subPath", "")
            text = re.sub(rf"(?<![\w.:/-]){re.escape(mount['mountPath'])}(?=/|$|[\s\"';])", str(local), text)
        return text

    def _resolve(self, host: str, port: int) -> str | None:
        """A Service's or a pod's DNS name and port → 127.0.0.1:<local port>; None for any other host."""
        host = re.sub(rf"(\.{NAMESPACE})?\.svc(\.cluster\.local)?$", "", host)
        services = {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "Service"}
        first, _, rest = host.partition(".")
        if rest in services and services[rest]["spec"].get("clusterIP") == "None":  # pod.headless-service
            candidates = [p for p in self.pods if p.name == first]
            service = services[rest]
        elif host in services:
            service = services[host]
            selector = service["spec"]["selector"]
            candidates = [p for p in self.pods if selector.items() <= p.labels.items()]
        else:
            return None
        assert candidates, f"{host} names no pod run here"
        service_port = next(p for p in service["spec"]["ports"] if p["port"] == port)
        target = service_port.get("targetPort", port)
        pod = candidates[0]
        container = next(c for c in pod.spec["containers"] if any(
            p["containerPort"] == target or p.get("name") == target for p in c.get("ports", [])))  # fmt: skip
        return f"127.0.0.1:{pod.port(container, target)}"

    # ---- a container's process -------------------------------------------------------------------------------

    def env(self, pod: Pod, container: Object) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source.get("secretRef")
            kind = "ConfigMap" if "configMapRef" in source else "Secret"
            env |= {k: v.decode() for k, v in self._data(kind, ref["name"]).items()}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": POD_IP}
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            else:
                ref = source.get("configMapKeyRef") or source.get("secretKeyRef")
                kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
                env[var["name"]] = self._data(kind, ref["name"])[ref["key"]].decode()
        return {k: self.rewrite(pod, container, v) for k, v in env.items()}

    def command(self, pod: Pod, container: Object, env: dict[str, str]) -> list[str]:
        command = container.get("command") or IMAGE_ENTRYPOINTS[container["image"]]
        return [self.rewrite(pod, container, expand(a, env)) for a in command + container.get("args", [])]

    def process_env(self, pod: Pod, container: Object) -> dict[str, str]:
        """The container's environment, on this machine's (no PDSERVE_* or OTEL_* of the test run's own), with
        the image's executables first on PATH."""
        shims = self._shims(pod, container)
        host = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))}
        path = os.pathsep.join([str(shims), str(Path(sys.executable).parent), host.get("PATH", "")])
        return host | self.env(pod, container) | {"PATH": path, "PYTHONPATH": str(ROOT)}

    def _shims(self, pod: Pod, container: Object) -> Path:
        directory = pod.directory / "bin" / container["name"]
        if not directory.exists():
            directory.mkdir(parents=True)
            scripts = {name: f"#!/bin/sh\n{body}\n" for name, body in SHIMS.items()}
            scripts |= {n: self.rewrite(pod, container, p.read_text()) for n, p in IMAGE_SCRIPTS.items()}
            for name, script in scripts.items():
                (directory / name).write_text(script)
                (directory / name).chmod(0o755)
        return directory

    def run_init(self, pod: Pod, timeout_s: float) -> None:
        """Every init container of `pod`, in order, each to a successful end."""
        for container in pod.spec.get("initContainers", []):
            env = self.process_env(pod, container)
            log = pod.directory / f"{container['name']}.log"
            with log.open("wb") as out:
                rc = subprocess.run(self.command(pod, container, env), env=env, cwd=pod.directory, stdout=out,
                                    stderr=subprocess.STDOUT, timeout=timeout_s).returncode  # fmt: skip
            assert rc == 0, f"{pod.name}/{container['name']} exited {rc}:\n{log.read_text()[-3000:]}"

    def start(self, pod: Pod) -> None:
        for container in pod.spec["containers"]:
            env = self.process_env(pod, container)
            out = (pod.directory / f"{container['name']}.log").open("wb")
            pod.procs[container["name"]] = subprocess.Popen(
                self.command(pod, container, env), env=env, cwd=pod.directory, stdout=out, stderr=subprocess.STDOUT
            )

    def log(self, pod: Pod, container: str) -> str:
        return (pod.directory / f"{container}.log").read_text(errors="replace")[-4000:]

    # ---- probes and stopping -------------------------------------------------------------------------------

    def probe(self, pod: Pod, container: Object, probe: Object) -> bool:
        """One try of a probe, as the kubelet makes it (timeoutSeconds, default 1 s)."""
        timeout = probe.get("timeoutSeconds", 1)
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://127.0.0.1:{pod.port(container, get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            except (OSError, urllib.error.HTTPError):
                return False
        if "tcpSocket" in probe:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(
                    ("127.0.0.1", pod.port(container, probe["tcpSocket"]["port"])), timeout=timeout
                ),
            ):
                return True
            return False
        env = self.process_env(pod, container)
        command = [self.rewrite(pod, container, a) for a in probe["exec"]["command"]]
        try:
            return subprocess.run(command, env=env, capture_output=True, timeout=max(timeout, 5)).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_for(self, pod: Pod, kind: str, timeout_s: float) -> None:
        """Until every container's `kind` probe (startupProbe, readinessProbe, livenessProbe) passes."""
        deadline = time.monotonic() + timeout_s
        for container in pod.spec["containers"]:
            probe = container.get(kind)
            assert probe is not None, f"{pod.name}/{container['name']} has no {kind}"
            name = container["name"]
            while not self.probe(pod, container, probe):
                assert pod.procs[name].poll() is None, f"{pod.name}/{name} exited:\n{self.log(pod, name)}"
                late = time.monotonic() > deadline
                assert not late, f"{pod.name}/{name}: no {kind} in {timeout_s} s:\n{self.log(pod, name)}"
                time.sleep(0.2)

    def stop(self, pod: Pod) -> dict[str, tuple[int | None, float]]:
        """Terminate `pod` as the kubelet does: each container's preStop hook, then SIGTERM, then SIGKILL past
        terminationGracePeriodSeconds (30 s unless set). Returns container → (exit code, seconds since the start
        of termination); a None code: it was killed."""
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        began = time.monotonic()
        for container in pod.spec["containers"]:
            hook = container.get("lifecycle", {}).get("preStop")
            if hook is not None:
                subprocess.run([self.rewrite(pod, container, a) for a in hook["exec"]["command"]],
                               env=self.process_env(pod, container), timeout=grace)  # fmt: skip
        for proc in pod.procs.values():
            proc.send_signal(signal.SIGTERM)
        ended = {}
        for name, proc in pod.procs.items():
            try:
                rc: int | None = proc.wait(timeout=max(0.0, began + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            ended[name] = (rc, time.monotonic() - began)
        pod.procs.clear()
        return ended

    def kill_all(self) -> None:
        for pod in self.pods:
            for proc in pod.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            pod.procs.clear()
