"""The Kubernetes deployment (deploy/k8s/) checked offline: every overlay rendered (tests/kustomize.py; held to
`kubectl kustomize` where kubectl is installed), every object against the Kubernetes schemas
(kubernetes-validate, strict: no unknown field) of the oldest and newest versions named here, the KEDA
ScaledObjects (a CRD the schemas lack) by their structure; its contract with the code (settings, ports, probes,
drain time, secrets, the planner: advisory, scraped, its metric the autoscalers'); and the base's pods started here,
each container's command with the environment, files and addresses its pod would give it (tests/k8s_local.py), until
every probe passes, a completion goes through (the planner: its desired counts published), and every pod stops within
its grace period."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import re
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared import bus
from shared.config_fields import knobs
from shared.settings import GatewaySettings, PlannerSettings, WorkerSettings, from_env
from shared.telemetry import metrics
from shared.telemetry.lifecycle import EXIT_GRACE_S
from tests.k8s_local import IMAGE_ENTRYPOINTS, LocalCluster, containers_of
from tests.kustomize import apply_operation, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("hpa", "keda", "gpu")
KUBERNETES_VERSIONS = ("1.30", "1.37")  # the oldest still widely run, and the newest kubernetes-validate knows
PLANNER_METRIC = "pdserve:planner_desired_workers"  # the planner's desired worker count per role (label `role`)
ADAPTER_METRIC = "pdserve_planner_desired_workers"  # its name as the Prometheus adapter serves it (External)
WORKER_ROLES = ("prefill", "decode")
PDSERVE_IMAGES = {"pdserve:latest", "pdserve-gateway:latest"}
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
Object = dict[str, Any]


@pytest.fixture(scope="module")
def deploy(tmp_path_factory) -> Path:
    """A copy of deploy/k8s/ with the secrets docker/secrets_init.py writes (as the documented first step)."""
    copy = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets"))
    spec = importlib.util.spec_from_file_location("pdserve_secrets_init", ROOT / "docker" / "secrets_init.py")
    assert spec is not None and spec.loader is not None
    secrets_init = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(secrets_init)
    assert secrets_init.main([str(copy / "base" / "secrets")], environ={}) == 0
    return copy


@pytest.fixture(scope="module")
def rendered(deploy) -> dict[str, list[Object]]:
    return {name: render(deploy / "overlays" / name) for name in OVERLAYS} | {"base": render(deploy / "base")}


def one(objects: list[Object], kind: str, name: str) -> Object:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def kinds(objects: list[Object], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def secrets_of(objects: list[Object]) -> dict[str, str]:
    """The generated Secret's values (secrets_init ends each with a newline, which `_FILE` reading strips)."""
    data = one(objects, "Secret", "pdserve-secrets")["data"]
    return {k: base64.b64decode(v).decode().strip() for k, v in data.items()}


def component(obj: Object) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(objects: list[Object]) -> dict[str, Object]:
    return kinds(objects, "Deployment") | kinds(objects, "StatefulSet")


def pod_spec(workload: Object) -> Object:
    return workload["spec"]["template"]["spec"]


def main_container(workload: Object) -> Object:
    (container,) = pod_spec(workload)["containers"]
    return container


# ---- rendering and the schemas --------------------------------------------------------------------------------


def _normal(objects: list[Object]) -> list[Object]:
    """Sorted by kind and name, Secret data decoded (kustomize wraps base64 lines)."""
    out = []
    for obj in sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"])):
        if obj["kind"] == "Secret":
            obj = obj | {"data": {k: base64.b64decode(v) for k, v in obj["data"].items()}}
        out.append(obj)
    return out


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the rendering is not compared")
def test_rendering_is_kustomizes(deploy, rendered):
    for name in ("base", *OVERLAYS):
        directory = deploy / "base" if name == "base" else deploy / "overlays" / name
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True)
        assert _normal(list(yaml.safe_load_all(out.stdout))) == _normal(rendered[name]), name


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    distinct = {json.dumps(o, sort_keys=True): o for objects in rendered.values() for o in objects}  # once each
    checked = set()
    for obj in distinct.values():
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: test_keda_scaled_objects
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
        checked.add((obj["kind"], obj["metadata"]["name"]))
    assert {k for k, _ in checked} == {"ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
                                       "PodDisruptionBudget", "HorizontalPodAutoscaler"}  # fmt: skip
    # the validation can fail: a misspelt field, a wrong type
    deployment = json.loads(json.dumps(one(rendered["base"], "Deployment", "pdserve-prefill")))
    apply_operation(deployment, {"op": "add", "path": "/spec/template/spec/terminationGracePeriod", "value": 90})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    apply_operation(deployment, {"op": "remove", "path": "/spec/template/spec/terminationGracePeriod"})
    apply_operation(deployment, {"op": "replace", "path": "/spec/replicas", "value": "one"})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_overlays_differ_only_by_what_they_add(rendered):
    base = _normal(rendered["base"])
    hpa, keda = rendered["hpa"], rendered["keda"]
    assert _normal([o for o in hpa if o["kind"] != "HorizontalPodAutoscaler"]) == base
    assert _normal([o for o in keda if o["kind"] != "ScaledObject"]) == base
    assert (
        set(kinds(hpa, "HorizontalPodAutoscaler"))
        == set(kinds(keda, "ScaledObject"))
        == {f"pdserve-{role}" for role in WORKER_ROLES}
    )
    assert not kinds(keda, "HorizontalPodAutoscaler")  # KEDA makes its own: two would fight over the replicas
    assert kinds(rendered["gpu"], "HorizontalPodAutoscaler") == kinds(hpa, "HorizontalPodAutoscaler")


# ---- the contract with the code -------------------------------------------------------------------------------


def test_the_images_are_the_ones_compose_builds_and_runs(rendered):
    compose_images = {svc["image"] for svc in COMPOSE.values() if "image" in svc}
    assert set(IMAGE_ENTRYPOINTS) == PDSERVE_IMAGES <= compose_images
    assert json.loads(_dockerfile_op("ENTRYPOINT", "gateway")) == IMAGE_ENTRYPOINTS["pdserve-gateway:latest"]
    assert json.loads(_dockerfile_op("ENTRYPOINT", None)) == IMAGE_ENTRYPOINTS["pdserve:latest"]
    images = _images(rendered["base"])
    assert images == PDSERVE_IMAGES | {COMPOSE["nats"]["image"], COMPOSE["redis"]["image"]}


def _images(objects: list[Object]) -> set[str]:
    return {c["image"] for w in workloads(objects).values() for c in containers_of(pod_spec(w))}


def _dockerfile_op(op: str, stage: str | None) -> str:
    """An instruction's argument in a Dockerfile stage (`FROM ... AS stage`; None: the last stage)."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()]
    stages: list[list[str]] = []
    for line in lines:
        if line.startswith("FROM "):
            stages.append([line])
        elif stages and line and not line.startswith("#"):
            stages[-1].append(line)
    chosen = stages[-1] if stage is None else next(s for s in stages if s[0].endswith(f" AS {stage}"))
    (arg,) = [line.split(None, 1)[1] for line in chosen if line.split(None, 1)[0] == op]
    return arg


def raw_env(objects: list[Object], container: Object) -> dict[str, str]:
    """A container's environment as written (ConfigMaps of envFrom, then env); a fieldRef as `fieldRef:<path>`."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= one(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else f"fieldRef:{var['valueFrom']['fieldRef']['fieldPath']}"
    return env


def port_named(container: Object, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


Settings = GatewaySettings | PlannerSettings | WorkerSettings


def settings_class(role: str) -> type:
    return {"gateway": GatewaySettings, "planner": PlannerSettings}.get(role, WorkerSettings)


def planner_settings(env: dict[str, str], container: Object) -> PlannerSettings:
    """The planner's settings as `pdserve planner` builds them from its container's args and `env`."""
    from services.cli import _planner_settings

    command = container.get("command") or IMAGE_ENTRYPOINTS[container["image"]]
    argv = command + container.get("args", [])
    assert argv[:2] == ["pdserve", "planner"], argv
    return _planner_settings(argv[2:], env)


def raw_settings(objects: list[Object], role: str, container: Object) -> Settings:
    """A service's settings from its environment as written, secret files and fieldRefs left out (the planner's: its
    args too)."""
    env = {k: v for k, v in raw_env(objects, container).items() if not k.endswith("_FILE") and "fieldRef:" not in v}
    if role == "gateway":
        return from_env(GatewaySettings, env)
    if role == "planner":
        return planner_settings(env | {"PDSERVE_CLUSTER_SECRET": "x" * 16}, container)
    return from_env(WorkerSettings, env, role=role, cluster_secret="x" * 16)


def pdserve_roles(objects: list[Object]) -> dict[str, Object]:
    """gateway | prefill | decode | planner → its Deployment."""
    deployments = kinds(objects, "Deployment").values()
    return {component(w): w for w in deployments if main_container(w)["image"] in PDSERVE_IMAGES}


def test_environment_names_are_settings_fields(rendered):
    fields = {cls: {k.name for k in knobs(cls)} for cls in (GatewaySettings, PlannerSettings, WorkerSettings)}
    roles = pdserve_roles(rendered["gpu"])
    assert set(roles) == {"gateway", "planner", *WORKER_ROLES}
    for role, workload in roles.items():
        for container in containers_of(pod_spec(workload)):
            names = {v.removeprefix("PDSERVE_").removesuffix("_FILE").lower()
                     for v in raw_env(rendered["gpu"], container) if v.startswith("PDSERVE_")}  # fmt: skip
            assert names and names <= fields[settings_class(role)], (role, names - fields[settings_class(role)])


def test_settings_parse_with_the_secrets_and_agree_with_the_ports(rendered, tmp_path):
    """Each service's environment, with its Secret's files where its pod mounts them, builds valid settings that
    carry the generated secrets; the ports the settings bind are the containers' declared ones."""
    objects = rendered["base"]
    secret = secrets_of(objects)
    cluster = LocalCluster(objects, tmp_path)  # writes each pod's volumes, where env() points the paths
    for role, workload in pdserve_roles(objects).items():
        pod = cluster.pod(f"{workload['metadata']['name']}-0")
        container = main_container(workload)
        env = cluster.env(pod, container)
        if role == "planner":
            settings = planner_settings(env, container)
        else:
            extra = {} if role == "gateway" else {"role": role}
            settings = from_env(settings_class(role), env, **extra)
        assert settings.nats_user == "pdserve" and settings.nats_password == secret["nats_password"], role
        assert settings.redis_password == secret["redis_password"], role
        raw = raw_settings(objects, role, container)
        if isinstance(raw, GatewaySettings):
            assert isinstance(settings, GatewaySettings) and settings.api_keys == (secret["api_keys"],)
            assert raw.port == port_named(container, "http")
            continue
        if isinstance(raw, PlannerSettings):  # the secret that signs role switches, should they be turned on
            assert isinstance(settings, PlannerSettings) and settings.cluster_secret == secret["cluster_secret"]
            assert raw.host == "0.0.0.0" and raw.port == port_named(container, "http")
            continue
        assert isinstance(settings, WorkerSettings) and settings.cluster_secret == secret["cluster_secret"], role
        assert raw.metrics_host == "0.0.0.0" and raw.metrics_port == port_named(container, "metrics"), role
        assert raw.engine.device == "cpu" and raw.kv.backend == "gloo", role
        if role == "prefill":
            assert raw.kv.rpc_host == "0.0.0.0" and raw.kv.rpc_port == port_named(container, "kv-rpc")
            # decode workers dial the pod's IP: a pod's host name resolves nowhere else
            assert raw_env(objects, container)["PDSERVE_ADVERTISE_HOST"] == "fieldRef:status.podIP"


def test_probes_ask_what_each_service_answers(rendered):
    for role, workload in pdserve_roles(rendered["base"]).items():
        container = main_container(workload)
        port = "http" if role in ("gateway", "planner") else "metrics"
        for kind, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
            assert container[kind]["httpGet"] == {"path": path, "port": port}, (role, kind)
    nats = main_container(one(rendered["base"], "StatefulSet", "pdserve-nats"))
    assert {nats[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "/healthz", "/healthz?js-server-only=true", "/healthz?js-enabled-only=true"}  # fmt: skip
    redis = main_container(one(rendered["base"], "Deployment", "pdserve-redis"))
    assert "| grep -q PONG" in redis["readinessProbe"]["exec"]["command"][-1]  # NOAUTH exits 0 too


def test_the_grace_period_covers_the_drain(rendered):
    """SIGTERM drains for up to drain_timeout_s (+ the exit grace); a prefill worker's held KV is pulled or expired
    within its lease, which ends before the drain does; the kubelet's SIGKILL comes only after."""
    objects = rendered["base"]
    for role, workload in pdserve_roles(objects).items():
        if role == "planner":
            continue  # nothing to drain: a SIGTERM stops it within seconds (test_the_planner_starts_here_and_publishes)
        container = main_container(workload)
        settings = raw_settings(objects, role, container)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace >= pause + settings.drain_timeout_s + EXIT_GRACE_S + 5, role
        if isinstance(settings, WorkerSettings) and role == "prefill":
            assert settings.kv.lease_s < settings.drain_timeout_s
    assert pdserve_roles(objects)["gateway"]["spec"]["replicas"] >= 2  # one drains while the other serves


def test_each_pod_mounts_only_the_secrets_it_reads(rendered):
    objects = rendered["base"]
    wanted = {"gateway": {"api_keys", "nats_password", "redis_password"},
              "prefill": {"cluster_secret", "nats_password", "redis_password"},
              "decode": {"cluster_secret", "nats_password", "redis_password"},
              "planner": {"cluster_secret", "nats_password", "redis_password"},
              "nats": {"nats_password"}, "redis": {"redis_password"}}  # fmt: skip
    for workload in workloads(objects).values():
        (volume,) = [v for v in pod_spec(workload)["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "pdserve-secrets"
        keys = {item["key"] for item in volume["secret"]["items"]}
        assert keys == wanted[component(workload)], component(workload)
        assert volume["secret"]["defaultMode"] == 0o440  # the pod's group (fsGroup) reads them, nobody else
        for container in pod_spec(workload)["containers"]:
            mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
            assert mount["readOnly"] and mount["mountPath"] == "/run/secrets"
            files = {v for k, v in raw_env(objects, container).items() if k.endswith("_FILE")}
            assert files <= {f"/run/secrets/{k}" for k in keys}, component(workload)
    assert set(one(objects, "Secret", "pdserve-secrets")["data"]) == set().union(*wanted.values())


def test_selectors_services_and_routes_agree(rendered):
    objects = rendered["base"]
    labelled = {}
    for name, workload in workloads(objects).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert labels["app.kubernetes.io/part-of"] == "pdserve" and labels["app.kubernetes.io/name"] == "pdserve"
        labelled[name] = labels
    services = kinds(objects, "Service")
    for name, service in services.items():
        selector = service["spec"]["selector"].items()
        assert [w for w, labels in labelled.items() if selector <= labels.items()], f"{name} selects no pod"
    nats = one(objects, "StatefulSet", "pdserve-nats")
    headless = services[nats["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
    conf = one(objects, "ConfigMap", "pdserve-nats-config")["data"]["nats.conf"]
    cluster_port = port_named(main_container(nats), "cluster")
    routes = {f"nats://pdserve-nats-{i}.{nats['spec']['serviceName']}:{cluster_port}"
              for i in range(nats["spec"]["replicas"])}  # fmt: skip
    assert nats["spec"]["replicas"] == 3 and routes == set(re.findall(r"nats://\S+", conf))
    assert "store_dir: /data" in conf and any(m["mountPath"] == "/data" for m in main_container(nats)["volumeMounts"])


def test_a_disruption_budget_per_role(rendered):
    objects = rendered["base"]
    budgets = kinds(objects, "PodDisruptionBudget")
    for name, workload in workloads(objects).items():
        if component(workload) in ("redis", "planner"):
            continue  # one replica: a budget would block node drains, or allow everything
        labels = workload["spec"]["template"]["metadata"]["labels"].items()
        (budget,) = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels]
        assert budget["spec"]["maxUnavailable"] == 1, name  # one drains at a time
    assert {component(b) for b in budgets.values()} == {"gateway", "prefill", "decode", "nats"}


def test_autoscalers_follow_the_planners_desired_count(rendered):
    adapter = yaml.safe_load((K8S / "overlays" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["external"]
    assert rule["name"]["as"] == ADAPTER_METRIC and PLANNER_METRIC in rule["seriesQuery"]
    assert rule["name"]["matches"] == f"^{PLANNER_METRIC}$" and rule["metricsQuery"].endswith("by (role)")
    deployments = kinds(rendered["hpa"], "Deployment")
    for hpa in kinds(rendered["hpa"], "HorizontalPodAutoscaler").values():
        spec = hpa["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        role = component(target)
        assert role in WORKER_ROLES and component(hpa) == role and spec["scaleTargetRef"]["kind"] == "Deployment"
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {"name": ADAPTER_METRIC, "selector": {"matchLabels": {"role": role}}}
        # AverageValue 1: replicas = ceil(desired / 1), the planner's count
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert spec["minReplicas"] >= 1 and spec["maxReplicas"] >= spec["minReplicas"]
        assert spec["behavior"]["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 90}]


def test_the_planner_is_advisory_and_scraped_where_the_autoscalers_read(rendered):
    """One planner per deployment, in every overlay, advisory (a switched pod would still count as one of its
    Deployment's replicas: the autoscaler and the planner would fight), serving the metric the autoscalers scale on
    where Prometheus' pod annotations point."""
    for overlay in ("base", *OVERLAYS):
        planner = pdserve_roles(rendered[overlay])["planner"]
        assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"] == {"type": "Recreate"}, overlay
        container = main_container(planner)
        settings = raw_settings(rendered[overlay], "planner", container)
        assert isinstance(settings, PlannerSettings) and not settings.switch_roles, overlay
        annotations = planner["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.port),
                               "prometheus.io/path": "/metrics"}, overlay  # fmt: skip
        assert port_named(container, "http") == settings.port
    # what it serves on /metrics is the series the autoscalers query, by role
    (family,) = metrics.PLANNER_DESIRED_WORKERS.describe()
    assert family.name == PLANNER_METRIC and "role" in metrics.PLANNER_DESIRED_WORKERS._labelnames
    # the advisory flag is the manifest's choice: without it the same settings switch roles
    planner = pdserve_roles(rendered["base"])["planner"]
    switching = json.loads(json.dumps(main_container(planner)))
    switching["args"] = [a for a in switching["args"] if a != "--no-switch-roles"]
    settings = raw_settings(rendered["base"], "planner", switching)
    assert isinstance(settings, PlannerSettings) and settings.switch_roles


KEDA_SPEC = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
             "idleReplicaCount", "fallback", "advanced", "triggers"}  # fmt: skip


def test_keda_scaled_objects(rendered):
    """Not in the Kubernetes schemas (a CRD): their structure, the planner's query per role, and their HPA behaviour
    validated as the HPA that KEDA makes of it."""
    deployments = kinds(rendered["keda"], "Deployment")
    hpas = kinds(rendered["hpa"], "HorizontalPodAutoscaler")
    for name, scaled in kinds(rendered["keda"], "ScaledObject").items():
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        assert set(spec) <= KEDA_SPEC, set(spec) - KEDA_SPEC
        role = component(deployments[spec["scaleTargetRef"]["name"]])
        assert component(scaled) == role and set(spec["scaleTargetRef"]) == {"name"}  # a Deployment, by default
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold", "ignoreNullValues"}
        assert trigger["metadata"]["ignoreNullValues"] == "false"  # no planner: the counts stay (KEDA's default: 0)
        assert trigger["metadata"]["query"] == f'max({PLANNER_METRIC}{{role="{role}"}})'
        assert trigger["metadata"]["threshold"] == "1" and trigger["metadata"]["serverAddress"].startswith("http")
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        as_hpa = json.loads(json.dumps(hpas[name]))
        as_hpa["spec"]["behavior"] = behavior
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(as_hpa, version, strict=True)
        assert behavior == hpas[name]["spec"]["behavior"]  # the same policy, whichever autoscaler applies it


def test_the_gpu_overlay_gives_each_worker_a_gpu_and_nccl(rendered):
    for overlay in ("hpa", "keda"):
        assert "nvidia.com/gpu" not in json.dumps(rendered[overlay]), overlay
    objects = rendered["gpu"]
    roles = pdserve_roles(objects)
    assert "nvidia.com/gpu" not in json.dumps(roles["gateway"])
    for role in WORKER_ROLES:
        container = main_container(roles[role])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        settings = raw_settings(objects, role, container)
        assert isinstance(settings, WorkerSettings)
        assert settings.engine.device == "cuda" and settings.kv.backend == "nccl", role


# ---- the base's pods, started here ----------------------------------------------------------------------------

STARTUP_S = 180.0  # loading torch and the tiny model, three model-inits at once, on 2 shared cores


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _help_exits_cleanly(argv: list[str], main) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0, argv


def test_pdserve_containers_run_pdserve_commands(rendered, capsys):
    """Every pdserve container's command (the image's entrypoint and the container's args) is a pdserve command
    whose flags parse; model-init's arguments are `pdserve demo-model`'s (docker/model-init.sh hands them on)."""
    from services.cli import main as cli_main
    from services.gateway.main import main as gateway_main

    mains = {"pdserve": cli_main, "pdserve-gateway": gateway_main}
    for workload in pdserve_roles(rendered["base"]).values():
        for container in containers_of(pod_spec(workload)):
            command = container.get("command") or IMAGE_ENTRYPOINTS[container["image"]]
            argv = command + container.get("args", [])
            if argv[0] == "pdserve-model-init":
                _help_exits_cleanly(["demo-model", "/models/demo", *argv[1:]], cli_main)
            else:
                _help_exits_cleanly(argv[1:], mains[argv[0]])
    assert 'pdserve demo-model "$tmp" "$@"' in (ROOT / "docker" / "model-init.sh").read_text()
    capsys.readouterr()


def _start_infra(cluster: LocalCluster) -> list:
    """NATS's three servers and Redis, started and probed until ready; NATS's servers form one JetStream cluster."""
    infra = cluster.pods_of("nats") + cluster.pods_of("redis")
    for pod in infra:
        cluster.start(pod)
    for pod in infra:
        first = "startupProbe" if "startupProbe" in main_container(pod.workload) else "readinessProbe"
        for kind, timeout_s in ((first, 30), ("readinessProbe", 30), ("livenessProbe", 10)):
            cluster.wait_for(pod, kind, timeout_s)
    for pod in cluster.pods_of("nats"):
        monitor = pod.port(main_container(pod.workload), "monitor")
        routes = _json(f"http://127.0.0.1:{monitor}/routez")["routes"]  # pooled: several per peer
        peers = {r["remote_name"] for r in routes}
        assert peers == {p.name for p in cluster.pods_of("nats")} - {pod.name}, pod.name  # the other two
        meta = _json(f"http://127.0.0.1:{monitor}/jsz")["meta_cluster"]
        assert meta["cluster_size"] == 3 and meta["leader"], pod.name
    return infra


async def _nats_connects(settings: GatewaySettings, name: str) -> bool:
    try:
        nc = await asyncio.wait_for(bus.connect(settings, name), 2.0)
    except TimeoutError:
        return False
    await nc.close()
    return True


def _stop_all(cluster: LocalCluster, pods: list) -> None:
    """Terminate `pods` at once, as the kubelet does; each container exits 0 within its pod's grace period."""
    with ThreadPoolExecutor(len(pods)) as pool:
        for pod, ended in zip(pods, pool.map(cluster.stop, pods), strict=True):
            grace = pod.spec.get("terminationGracePeriodSeconds", 30)
            for name, (rc, seconds) in ended.items():
                assert rc == 0 and seconds < grace, f"{pod.name}/{name}: exit {rc} after {seconds:.1f} s " \
                    f"(grace {grace} s):\n{cluster.log(pod, name)}"  # fmt: skip


def test_the_infrastructure_starts_here(rendered, tmp_path):
    """NATS's and Redis's containers as their pods run them: the servers find each other over their routes and
    elect a JetStream leader; each answers its probes; Redis and NATS refuse a client without the password."""
    cluster = LocalCluster(rendered["base"], tmp_path)
    try:
        infra = _start_infra(cluster)
        redis = cluster.pods_of("redis")[0]
        port = redis.port(main_container(redis.workload), "redis")
        out = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in out.stdout + out.stderr
        nats = cluster.pods_of("nats")[1]
        client = nats.port(main_container(nats.workload), "client")
        anonymous = from_env(GatewaySettings, {"PDSERVE_NATS_URL": f"nats://127.0.0.1:{client}"})
        assert not asyncio.run(_nats_connects(anonymous, "k8s-anonymous"))
        password = secrets_of(rendered["base"])["nats_password"]
        member = GatewaySettings(nats_url=anonymous.nats_url, nats_user="pdserve", nats_password=password)
        assert asyncio.run(_nats_connects(member, "k8s-member"))
        _stop_all(cluster, infra)
    finally:
        cluster.kill_all()


def test_the_planner_starts_here_and_publishes_the_desired_counts(rendered, tmp_path):
    """The planner's container as its pod runs it, beside NATS and Redis (it needs no checkpoint): its probes pass,
    /metrics publishes the desired count per role within a few intervals, /plan says it switches nothing, and it
    exits 0 within its grace period on SIGTERM."""
    cluster = LocalCluster(rendered["base"], tmp_path)
    try:
        infra = _start_infra(cluster)
        (planner,) = cluster.pods_of("planner")
        cluster.start(planner)
        for kind, timeout_s in (("startupProbe", 60), ("readinessProbe", 10), ("livenessProbe", 10)):
            cluster.wait_for(planner, kind, timeout_s)
        port = planner.port(main_container(planner.workload), "http")
        settings = raw_settings(rendered["base"], "planner", main_container(planner.workload))
        assert isinstance(settings, PlannerSettings)
        deadline = time.monotonic() + 4 * settings.interval_s + 10
        wanted: dict[str, float] = {}
        while set(wanted) != set(WORKER_ROLES):
            assert time.monotonic() < deadline, cluster.log(planner, "planner")
            time.sleep(0.5)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            wanted = {m[0]: float(m[1]) for m in re.findall(
                rf'^{PLANNER_METRIC}{{[^}}]*role="(\w+)"[^}}]*}} (\S+)$', text, re.M)}  # fmt: skip
        assert all(n >= 1 for n in wanted.values()), wanted
        plan = _json(f"http://127.0.0.1:{port}/plan")
        assert plan["switch_roles"] is False and plan["model"] == "demo"
        _stop_all(cluster, [planner])
        _stop_all(cluster, infra)
    finally:
        cluster.kill_all()


@pytest.mark.slow  # three model-inits, two workers and a gateway: about a minute on 2 busy cores (make test-slow)
def test_the_base_starts_here_and_serves(rendered, tmp_path):
    """Every container of the base, as its pod would run it: NATS and Redis as above, each model-init writes the
    checkpoint, the workers, the gateway and the planner pass their startup, readiness and liveness probes, a
    completion goes through the gateway's Service (its KV pulled from the prefill worker's advertised pod IP), the
    planner counts the live workers, and each pod, terminated as the kubelet does, exits 0 within its grace period."""
    objects = json.loads(json.dumps(rendered["base"]))
    # The one change: every prompt down the remote path (as the suite's stacks do, tests/conftest.py), so that the
    # completion's KV is pulled from the prefill worker's advertised address (an idle stack computes a short
    # prompt on the decode worker, which would leave that address untried).
    gateway = main_container(one(objects, "Deployment", "pdserve-gateway"))
    remote = {"name": "PDSERVE_PREFILL_PATH", "value": "remote"}
    apply_operation(gateway, {"op": "add", "path": "/env/-", "value": remote})
    cluster = LocalCluster(objects, tmp_path)
    pdserve = [pod for role in ("gateway", *WORKER_ROLES, "planner") for pod in cluster.pods_of(role)]
    assert len(pdserve) == 4
    try:
        with ThreadPoolExecutor(len(pdserve)) as pool:  # the model-inits while NATS and Redis start
            inits = [pool.submit(cluster.run_init, pod, STARTUP_S) for pod in pdserve]
            infra = _start_infra(cluster)
            for pod, init in zip(pdserve, inits, strict=True):  # each pod once its model-init is done
                init.result()
                cluster.start(pod)
        for pod in pdserve:
            cluster.wait_for(pod, "startupProbe", STARTUP_S)
        for pod in pdserve:
            cluster.wait_for(pod, "readinessProbe", 30)  # the gateway's: a live prefill and decode worker
            cluster.wait_for(pod, "livenessProbe", 10)

        api_key = secrets_of(objects)["api_keys"]
        address = cluster.rewrite(cluster.pods[0], {}, "pdserve-gateway:80")  # the Service, from any pod
        body = json.dumps({"model": "demo", "prompt": "hello there", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://{address}/v1/completions", body, method="POST", headers={
            "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.load(r)
        assert answer["usage"]["completion_tokens"] == 4, answer
        prefill = cluster.pods_of("prefill")[0]
        port = prefill.port(main_container(prefill.workload), "metrics")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        sent = re.search(r'^pdserve:kv_transfer_bytes_total\{[^}]*role="prefill"[^}]*\} (\S+)$', metrics, re.M)
        assert sent and float(sent.group(1)) > 0, "no KV left the prefill worker"
        (planner,) = cluster.pods_of("planner")
        plan_url = f"http://127.0.0.1:{planner.port(main_container(planner.workload), 'http')}/plan"
        deadline = time.monotonic() + 30
        while (_json(plan_url)["latest"] or {}).get("current") != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, (_json(plan_url)["latest"], cluster.log(planner, "planner"))
            time.sleep(1)

        _stop_all(cluster, pdserve)  # as a namespace is deleted: every pod at once, the servers last
        _stop_all(cluster, infra)
    finally:
        cluster.kill_all()
