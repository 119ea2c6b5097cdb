"""The Docker deployment's contract, checked without Docker: compose.yaml and the Dockerfile must agree
with the code (settings fields, `pdserve` subcommands) and with what `docker compose up` needs (health
checks, start order, scalable workers, GPU reservations). The `observability` profile's Prometheus, Grafana
and Jaeger configuration must agree with the services and with the metrics the code defines. Security: API
keys on, every service with the credentials it needs from the secrets volume, nats and redis refusing whoever
lacks the password. docker/healthcheck.py, docker/secrets_init.py and the nats and redis commands of
compose.yaml run for real against local servers."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grimp
import pytest
import redis as redis_lib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import choose_encoder

from services.cli import main as cli_main
from services.gateway.main import main as gateway_main
from services.local.infra import free_port, wait_for_port
from shared import bus
from shared.config_fields import knobs
from shared.engine.config import EngineConfig
from shared.redis_client import explain_redis_error, redis_client
from shared.settings import GatewaySettings, WorkerSettings, from_env
from shared.telemetry import metrics
from shared.telemetry.tracing import exporters_wanted

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
BUILDERS = [name for name, svc in SERVICES.items() if "build" in svc]
IMAGES = {SERVICES[name]["image"] for name in BUILDERS}  # what the Dockerfile makes: every role's, the gateway's
GATEWAY_IMAGE = SERVICES["gateway"]["image"]  # entrypoint pdserve-gateway: its command is its flags
PDSERVE_SERVICES = {name for name, svc in SERVICES.items() if svc.get("image") in IMAGES}
ONE_SHOT = {name for name, svc in SERVICES.items() if svc.get("restart") == "no"}
GPU_PROFILE = {name for name, svc in SERVICES.items() if "gpu" in svc.get("profiles", [])}
OBSERVABILITY = {name for name, svc in SERVICES.items() if "observability" in svc.get("profiles", [])}
HA_PROFILE = {name for name, svc in SERVICES.items() if "ha" in svc.get("profiles", [])}
OBSERVABILITY_DIR = ROOT / "docker" / "observability"
# The OpenTelemetry variables compose passes on (read by shared/telemetry/tracing.py and the OTLP exporter).
OTEL_VARS = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value, shell: dict[str, str] | None = None):
    """What compose makes of a value with `shell`'s variables (default: none set): ${VAR:-default} → $VAR if
    set and not empty, else default; ${VAR} → $VAR or ''."""
    shell = shell or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: shell.get(m.group(1)) or m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v, shell) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, shell) for k, v in value.items()}
    return value


def command(name: str) -> list[str]:
    cmd = SERVICES[name].get("command", [])
    assert isinstance(cmd, list), f"{name}: use the exec (list) form for command"
    return cmd


def role(name: str) -> str | None:
    """The `pdserve` subcommand a long-running pdserve service runs (the gateway's image runs the gateway)."""
    if name not in PDSERVE_SERVICES or name in ONE_SHOT:
        return None
    return "gateway" if SERVICES[name]["image"] == GATEWAY_IMAGE else command(name)[0]


WORKERS = {name for name in PDSERVE_SERVICES if role(name) in ("prefill", "decode", "mixed")}


def volume_mounts(name: str) -> dict[str, str]:
    """Named volume → where a service mounts it (with :ro when read-only)."""
    mounts = {}
    for mount in interpolate(SERVICES[name].get("volumes", [])):
        source, target, *mode = str(mount).split(":")
        if not source.startswith(("./", "/")):
            mounts[source] = ":".join([target, *mode])
    return mounts


SECRET_READERS = {name for name in SERVICES if "secrets" in volume_mounts(name)} - {"secrets-init"}


def _shell_script(name: str) -> str:
    """The script of a service whose command is `sh -c <script>`, as the container gets it ($$ is a $)."""
    cmd = command(name)
    assert cmd[:2] == ["sh", "-c"] and len(cmd) == 3, name
    return interpolate(cmd[2]).replace("$$", "$")


def _load_script(name: str, path: str):
    """A script of docker/ as a module (they are installed as commands in the image, not as modules)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


secrets_init = _load_script("pdserve_secrets_init", "docker/secrets_init.py")
SECRETS_MOUNT = "/run/secrets"  # where the secrets volume is mounted


@pytest.fixture(scope="module", autouse=True)
def local_secrets(tmp_path_factory) -> Path:
    """What secrets-init writes into an empty volume (nothing set in the shell), here: environment() points
    the services' PDSERVE_*_FILE paths at it, so their settings parse as they would in the containers."""
    global _local_secrets
    _local_secrets = tmp_path_factory.mktemp("secrets")
    assert secrets_init.main([str(_local_secrets)], environ={}) == 0
    return _local_secrets


_local_secrets: Path | None = None


def environment(name: str, shell: dict[str, str] | None = None, raw: bool = False) -> dict[str, str]:
    """A service's environment as compose makes it; unless `raw`, with paths into the secrets volume moved
    to this test module's secrets-init output."""
    env = SERVICES[name].get("environment", {})
    assert isinstance(env, dict), f"{name}: use the mapping form for environment"
    env = {k: str(v) for k, v in interpolate(env, shell).items()}
    if not raw and _local_secrets is not None:
        env = {k: str(_local_secrets) + v.removeprefix(SECRETS_MOUNT) if v.startswith(SECRETS_MOUNT + "/") else v
               for k, v in env.items()}  # fmt: skip
    return env


def field_names(cls) -> set[str]:
    """The settings' flat names (PDSERVE_<NAME>, lower case)."""
    return {k.name for k in knobs(cls)}


# ---- compose.yaml ---------------------------------------------------------------------------------------


def test_expected_services_exist():
    expected = {"secrets-init", "nats", "redis", "model-init", "gateway", "prefill", "decode", "prefill-gpu"}
    assert expected | {"decode-gpu"} <= set(SERVICES)
    assert ONE_SHOT == {"model-init", "secrets-init"}
    assert WORKERS == {"prefill", "decode", "prefill-gpu", "decode-gpu"}
    assert GPU_PROFILE == {"prefill-gpu", "decode-gpu"}


def test_every_long_running_service_has_a_healthcheck():
    for name, svc in SERVICES.items():
        if name in ONE_SHOT:
            assert "healthcheck" not in svc, name
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert "disable" not in check, name


def _nats_conf() -> str:
    assert _mounts("nats") == {"/etc/nats/pdserve.conf": "./docker/nats.conf"}
    return (ROOT / "docker" / "nats.conf").read_text()


def test_infrastructure_healthchecks():
    nats = SERVICES["nats"]
    assert nats["image"].startswith("nats:") and nats["image"].endswith("-alpine")
    script = _shell_script("nats")
    assert "exec nats-server --jetstream --config /etc/nats/pdserve.conf" in script
    assert any("/healthz?js-enabled-only=true" in part for part in nats["healthcheck"]["test"])
    # monitoring listens inside the container only, where the healthcheck runs
    (monitor,) = re.findall(r'^http: "([^"]+)"', _nats_conf(), re.M)
    assert monitor.startswith("127.0.0.1:")
    assert f"http://{monitor}/healthz" in " ".join(nats["healthcheck"]["test"])
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:")
    # redis-cli prints NOAUTH and exits 0 without the password: the check logs in and wants PONG
    test = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "REDISCLI_AUTH=" in test[1] and test[1].endswith("| grep -q PONG")
    assert f"{SECRETS_MOUNT}/redis_password" in test[1]


def test_pdserve_healthchecks_check_their_own_role():
    for name in PDSERVE_SERVICES - ONE_SHOT:
        test = SERVICES[name]["healthcheck"]["test"]
        assert test == ["CMD", "pdserve-healthcheck", role(name)], name
        assert "start_period" in SERVICES[name]["healthcheck"], f"{name}: model loading needs a start_period"


def test_depends_on_waits_for_health_or_completion():
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions (the mapping form)"
        for dep, spec in deps.items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}'s health, which has no check"
            else:
                assert condition == "service_completed_successfully", f"{name} → {dep}: {condition}"
                assert dep in ONE_SHOT, f"{name} waits for {dep} to complete, but it keeps running"
    for name in PDSERVE_SERVICES - ONE_SHOT:
        deps = SERVICES[name]["depends_on"]
        assert deps["nats"]["condition"] == "service_healthy", name
        assert deps["redis"]["condition"] == "service_healthy", name
        assert deps["model-init"]["condition"] == "service_completed_successfully", name
    # everything that reads the secrets volume waits until secrets-init has filled it
    for name in SECRET_READERS:
        assert SERVICES[name]["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully", name


def test_gateway_publishes_8000():
    ports = interpolate(SERVICES["gateway"]["ports"])
    assert len(ports) == 1
    host_part, _, container_port = str(ports[0]).rpartition(":")
    assert container_port == "8000"
    assert host_part.rpartition(":")[2] == "8000"
    assert from_env(GatewaySettings, environment("gateway")).port == 8000


def test_workers_scale():
    """`docker compose up --scale prefill=N --scale decode=M` (docs/deploy.md, "Compose scaling"): each replica
    is its own worker: no fixed container name, published port or host name; its worker id and the address a
    prefill worker advertises come from its own host name (the container's), never from a value every replica
    would share; and a replica stopped by a scale-down drains (stop_grace_period), a prefill worker until its held
    KV is pulled or its lease expires."""
    for name in WORKERS:
        svc = SERVICES[name]
        for key in ("container_name", "ports", "hostname", "domainname", "mac_address"):
            assert key not in svc, f"{name}: {key} prevents --scale"
        env = environment(name)
        for var in ("PDSERVE_WORKER_ID", "PDSERVE_ADVERTISE_HOST", "PDSERVE_TRACE_FILE", "PDSERVE_RECORD_EXPERT_TRACE"):
            assert var not in env, f"{name}: {var} would be the same in every replica"
        one, other = (from_env(WorkerSettings, env, role=role(name)) for _ in range(2))
        assert socket.gethostname() in one.worker_id and one.worker_id != other.worker_id, name
        assert one.kv.advertise_host is None, name  # the wildcard rpc_host: the container's own name
        if one.role == "prefill":
            assert one.kv.lease_s < one.drain_timeout_s < _seconds(SERVICES[name]["stop_grace_period"]), name
        assert all(str(m).split(":")[-1] == "ro" for m in SERVICES[name]["volumes"]), f"{name}: replicas share them"
    header = (ROOT / "compose.yaml").read_text().split("\nx-pdserve")[0]
    assert "docker compose up --scale prefill=2 --scale decode=2" in header
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert "docker compose up -d --scale prefill=" in deploy and "python3 docker/compose_autoscale.py" in deploy


def test_stop_waits_for_the_drain():
    """SIGTERM makes the gateway and the workers finish what is in flight for up to drain_timeout_s; Docker
    sends SIGKILL after stop_grace_period (10 s unless set), which must leave them that time."""
    for name in PDSERVE_SERVICES - ONE_SHOT:
        grace = SERVICES[name].get("stop_grace_period")
        assert grace, f"{name}: Docker's default 10 s would SIGKILL a drain halfway"
        cls = GatewaySettings if role(name) == "gateway" else WorkerSettings
        settings = from_env(cls, environment(name), **({} if cls is GatewaySettings else {"role": role(name)}))
        assert _seconds(grace) > settings.drain_timeout_s + 5, name


def test_prefill_workers_advertise_a_reachable_address():
    for name in WORKERS:
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        if settings.role == "prefill":
            # The wildcard makes the transfer server advertise the container's hostname (a loopback
            # address would send decode workers to themselves).
            assert settings.kv.rpc_host == "0.0.0.0", name
            assert settings.kv.rpc_port != 0, f"{name}: a fixed port inside the container"


def test_gpu_profile_reserves_disjoint_gpus():
    ids: dict[str, set[str]] = {}
    for name in GPU_PROFILE:
        svc = SERVICES[name]
        assert "deploy" not in SERVICES[name.removesuffix("-gpu")], "CPU workers reserve no GPU"
        devices = interpolate(svc["deploy"]["resources"]["reservations"]["devices"])
        assert devices and all("gpu" in d["capabilities"] for d in devices), name
        ids[role(name)] = {str(i) for d in devices for i in d["device_ids"]}
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        assert settings.engine.device == "cuda" and settings.kv.backend == "nccl", name
    assert set(ids) == {"prefill", "decode"}
    assert ids["prefill"] and ids["decode"] and not ids["prefill"] & ids["decode"]
    for name in WORKERS - GPU_PROFILE:
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        assert settings.engine.device == "cpu" and settings.kv.backend == "gloo", name


def test_gpu_profile_puts_both_roles_on_one_gpu_when_told():
    """PREFILL_GPU=0 DECODE_GPU=0 with GPU_TRANSFER_BACKEND=gloo and a share each: the documented one-GPU form."""
    shell = {"PREFILL_GPU": "0", "DECODE_GPU": "0", "GPU_TRANSFER_BACKEND": "gloo",
             "PREFILL_GPU_MEMORY_UTILIZATION": "0.45", "DECODE_GPU_MEMORY_UTILIZATION": "0.45"}  # fmt: skip
    for name in GPU_PROFILE:
        devices = interpolate(SERVICES[name]["deploy"]["resources"]["reservations"]["devices"], shell)
        assert [i for d in devices for i in d["device_ids"]] == ["0"], name
        settings = from_env(WorkerSettings, environment(name, shell), role=role(name))
        assert (settings.kv.backend, settings.engine.gpu_memory_utilization) == ("gloo", 0.45), name


def test_each_worker_role_takes_its_own_kv_budget():
    """PREFILL_* / DECODE_* in the shell size that role's KV pool, CPU and GPU workers alike; unset, every
    worker keeps the engine's defaults (256 MiB on CPU, 0.9 of the GPU)."""
    default = EngineConfig(model="m")
    shell = {"PREFILL_KV_CACHE_BYTES": "1048576", "DECODE_KV_CACHE_BYTES": "4294967296"}
    shell |= {"PREFILL_GPU_MEMORY_UTILIZATION": "0.8", "DECODE_GPU_MEMORY_UTILIZATION": "0.95"}
    given = {"prefill": (1 << 20, 0.8), "decode": (4 << 30, 0.95)}
    for name in WORKERS:
        engine = from_env(WorkerSettings, environment(name), role=role(name)).engine
        assert (engine.kv_cache_bytes, engine.gpu_memory_utilization) == (None, default.gpu_memory_utilization)
        engine = from_env(WorkerSettings, environment(name, shell), role=role(name)).engine
        kv_bytes, utilization = given[role(name)]
        assert engine.kv_cache_bytes == kv_bytes, name
        if name in GPU_PROFILE:
            assert engine.gpu_memory_utilization == utilization, name


def test_each_worker_role_takes_its_own_parallel_layout():
    """PREFILL_TP / DECODE_TP / *_EP in the shell make that role's workers groups (PDSERVE_TP, PDSERVE_EP);
    unset, every worker is one process."""
    shell = {"PREFILL_TP": "2", "DECODE_TP": "4", "DECODE_EP": "4"}
    given = {"prefill": (2, 1), "decode": (4, 4)}
    for name in WORKERS:
        engine = from_env(WorkerSettings, environment(name), role=role(name)).engine
        assert (engine.tp, engine.ep) == (1, 1), name
        engine = from_env(WorkerSettings, environment(name, shell), role=role(name)).engine
        assert (engine.tp, engine.ep) == given[role(name)], name
    with pytest.raises(ValueError, match="each 1 or the group size"):
        from_env(WorkerSettings, environment("decode", {"DECODE_TP": "2", "DECODE_EP": "4"}), role="decode")


def test_models_volume_is_mounted_everywhere_it_is_read():
    assert "models" in COMPOSE["volumes"]
    for name in PDSERVE_SERVICES - {"secrets-init"}:
        mounts = [str(m) for m in interpolate(SERVICES[name]["volumes"])]
        models = [m for m in mounts if m.split(":")[1] == "/models"]
        assert models, f"{name} does not mount /models"
        source, _, rest = models[0].partition(":")
        assert source == "models", name
        read_only = rest.endswith(":ro")
        assert read_only == (name not in ONE_SHOT), f"{name}: only model-init writes checkpoints"
        model = environment(name)["PDSERVE_MODEL"]
        assert model.startswith("/models/"), name
    assert len({environment(n)["PDSERVE_MODEL"] for n in PDSERVE_SERVICES - {"secrets-init"}}) == 1


def test_environment_names_are_settings_fields():
    gateway_fields, worker_fields = field_names(GatewaySettings), field_names(WorkerSettings)
    # secrets-init reads the user's own secrets, by the names the services' settings give them
    assert {v.removeprefix("PDSERVE_").lower() for v in environment("secrets-init")} == set(secrets_init.SECRETS)
    for name in PDSERVE_SERVICES - {"secrets-init"}:
        fields = gateway_fields if role(name) == "gateway" else worker_fields
        for var in environment(name):
            if var.startswith("OTEL_"):
                assert var in OTEL_VARS, f"{name}: {var}"
                continue
            assert var.startswith("PDSERVE_"), f"{name}: {var}"
            field = var.removeprefix("PDSERVE_").removesuffix("_FILE").lower()  # PDSERVE_<FIELD>_FILE too
            assert field in fields, f"{name}: {var} is no settings field"
    # ... and every PDSERVE_* variable the file interpolates from the user's shell is one too.
    all_fields = gateway_fields | worker_fields
    for var in re.findall(r"\$\{(PDSERVE_[A-Z0-9_]+)", (ROOT / "compose.yaml").read_text()):
        assert var.removeprefix("PDSERVE_").lower() in all_fields, var


def test_environment_values_parse():
    """With nothing set in the shell, every service's environment builds valid settings."""
    for name in PDSERVE_SERVICES - ONE_SHOT:
        if role(name) == "gateway":
            settings = from_env(GatewaySettings, environment(name))
            assert len(settings.api_keys) == 1  # generated by secrets-init
        else:
            settings = from_env(WorkerSettings, environment(name), role=role(name))
            assert settings.engine.threads and settings.engine.dtype is None
        assert settings.nats_url == "nats://nats:4222" and settings.redis_url.startswith("redis://redis:6379")
        assert settings.model_name is None and settings.served_model_name == "demo"


def _help_exits_cleanly(argv: list[str], main=cli_main) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0, argv


def test_commands_are_pdserve_subcommands(capsys):
    for name in PDSERVE_SERVICES - ONE_SHOT:
        assert "entrypoint" not in SERVICES[name], f"{name} runs the image's entrypoint, pdserve (pdserve-gateway)"
        if role(name) == "gateway":
            _help_exits_cleanly(command(name), gateway_main)
        else:
            _help_exits_cleanly(command(name))
    # secrets-init takes the directory the volume is mounted at
    assert SERVICES["secrets-init"]["entrypoint"] == ["pdserve-secrets-init"]
    assert command("secrets-init") == [SECRETS_MOUNT]
    # model-init passes its command on to `pdserve demo-model <dir>`
    assert SERVICES["model-init"]["entrypoint"] == ["pdserve-model-init"]
    _help_exits_cleanly(["demo-model", "/models/demo", *command("model-init")])
    assert 'pdserve demo-model "$tmp" "$@"' in (ROOT / "docker" / "model-init.sh").read_text()
    capsys.readouterr()


def test_each_image_built_once():
    # One service builds each image (building one in several races in some compose versions): secrets-init the
    # image of every role, the gateway its own (no torch); all the others wait for secrets-init, so the image
    # exists before compose looks for it.
    assert BUILDERS == ["secrets-init", "gateway"]
    build = SERVICES["secrets-init"]["build"]
    assert build["context"] == "."
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    assert set(build.get("args", {})) <= args
    assert SERVICES["secrets-init"]["image"] == "pdserve:latest"
    assert SERVICES["gateway"]["build"] == {"context": ".", "target": "gateway"}
    assert re.search(r"^FROM \S+ AS gateway$", dockerfile, re.M)
    assert GATEWAY_IMAGE == "pdserve-gateway:latest"
    for name in PDSERVE_SERVICES - {"secrets-init"}:
        assert "secrets-init" in SERVICES[name]["depends_on"], name


# ---- security: API keys, credentials, the secrets volume -------------------------------------------------


def _secret(name: str) -> str:
    return (_local_secrets / name).read_text().strip()


def test_secrets_volume_reaches_every_service_that_needs_it():
    assert "secrets" in COMPOSE["volumes"]
    assert volume_mounts("secrets-init")["secrets"] == SECRETS_MOUNT  # the only writer
    assert SECRET_READERS == (PDSERVE_SERVICES - ONE_SHOT) | {"nats", "redis"} | HA_PROFILE
    for name in SECRET_READERS:
        assert volume_mounts(name)["secrets"] == f"{SECRETS_MOUNT}:ro", name


def test_every_pdserve_service_gets_its_credentials():
    """From the secrets volume, through PDSERVE_<FIELD>_FILE: NATS and Redis passwords for all, the cluster
    secret for every worker, API keys for the gateway (on by default)."""
    for name in PDSERVE_SERVICES - ONE_SHOT:
        env = environment(name, raw=True)
        # secrets only as files: none in an environment variable, where `docker inspect` shows it
        for var in ("PDSERVE_NATS_PASSWORD", "PDSERVE_REDIS_PASSWORD", "PDSERVE_CLUSTER_SECRET", "PDSERVE_API_KEYS"):
            assert var not in env, f"{name}: {var} (an empty value would also hide {var}_FILE)"
        assert env["PDSERVE_NATS_PASSWORD_FILE"] == f"{SECRETS_MOUNT}/nats_password", name
        assert env["PDSERVE_REDIS_PASSWORD_FILE"] == f"{SECRETS_MOUNT}/redis_password", name
        if role(name) == "gateway":
            settings = from_env(GatewaySettings, environment(name))
            assert settings.api_keys == (_secret("api_keys"),), "API keys are on by default"
        else:
            settings = from_env(WorkerSettings, environment(name), role=role(name))
            assert settings.cluster_secret == _secret("cluster_secret"), name
        assert settings.nats_user == "pdserve" and settings.nats_password == _secret("nats_password"), name
        assert settings.redis_password == _secret("redis_password"), name
    # what the user sets in the shell reaches secrets-init, which stores it for the services
    shell = {"PDSERVE_API_KEYS": "k1,k2", "PDSERVE_NATS_PASSWORD": "mine"}
    given = environment("secrets-init", shell)
    assert given["PDSERVE_API_KEYS"] == "k1,k2" and given["PDSERVE_NATS_PASSWORD"] == "mine"
    assert given["PDSERVE_CLUSTER_SECRET"] == "" and given["PDSERVE_REDIS_PASSWORD"] == ""  # generated


def test_the_header_says_how_to_read_and_set_the_api_key():
    header = (ROOT / "compose.yaml").read_text().split("\nx-pdserve")[0]
    assert f"docker compose exec -T gateway cat {SECRETS_MOUNT}/api_keys" in header
    for variable in ("PDSERVE_API_KEYS", "PDSERVE_CLUSTER_SECRET", "PDSERVE_NATS_PASSWORD", "PDSERVE_REDIS_PASSWORD"):
        assert variable in header
    assert "docs/security.md" in header


def test_secrets_init_generates_keeps_and_takes_yours(tmp_path, capsys):
    directory = tmp_path / "secrets"
    assert secrets_init.main([str(directory)], environ={}) == 0
    first = {p.name: p.read_text() for p in directory.iterdir()}
    assert set(first) == {"api_keys", "cluster_secret", "nats_password", "redis_password"}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
        assert len(path.read_text().strip()) >= 32, path.name
        assert not set(path.read_text().strip()) & secrets_init.UNSAFE, path.name
    # a restart keeps them (clients and servers already use them)
    assert secrets_init.main([str(directory)], environ={}) == 0
    assert {p.name: p.read_text() for p in directory.iterdir()} == first
    # a value from the environment wins, and stays
    assert secrets_init.main([str(directory)], environ={"PDSERVE_API_KEYS": "key-a,key-b"}) == 0
    assert (directory / "api_keys").read_text() == "key-a,key-b\n"
    assert (directory / "nats_password").read_text() == first["nats_password"]
    assert secrets_init.main([str(directory)], environ={}) == 0
    assert (directory / "api_keys").read_text() == "key-a,key-b\n"
    out = capsys.readouterr().out
    for value in first.values():
        assert value.strip() not in out, "secrets-init prints no secret"
    # a password nats.conf or the redis command could not carry is refused, with the reason
    assert secrets_init.main([str(directory)], environ={"PDSERVE_REDIS_PASSWORD": 'a"b'}) == 1
    assert "PDSERVE_REDIS_PASSWORD" in capsys.readouterr().err
    assert secrets_init.main(["--help"]) == 2


def _run_infra(name: str, script: str, secrets_dir: Path, port: int) -> subprocess.Popen:
    script = script.replace(SECRETS_MOUNT + "/", f"{secrets_dir}/")
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 15, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def test_compose_nats_requires_the_password(tmp_path):
    """compose.yaml's nats command and docker/nats.conf, run here: the services' settings log in, a wrong
    password does not, and the healthcheck's monitoring endpoint answers."""
    port, monitor = free_port(), free_port()
    script = _shell_script("nats").replace(
        "--config /etc/nats/pdserve.conf",
        f"--config {ROOT / 'docker' / 'nats.conf'} -p {port} -m {monitor} -sd {tmp_path / 'js'}",  # flags win
    )
    assert "-p" in script  # the replacement happened
    proc = _run_infra("nats", script, _local_secrets, port)
    try:
        env = environment("gateway") | {"PDSERVE_NATS_URL": f"nats://127.0.0.1:{port}"}
        assert asyncio.run(_nats_connects(from_env(GatewaySettings, env), "compose-nats"))
        wrong = env | {"PDSERVE_NATS_PASSWORD": "wrong"}
        assert not asyncio.run(_nats_connects(from_env(GatewaySettings, wrong), "compose-nats-wrong"))
        assert "refused the credentials" in bus.connection_problem("compose-nats-wrong")
        anonymous = {"PDSERVE_NATS_URL": f"nats://127.0.0.1:{port}"}
        assert not asyncio.run(_nats_connects(from_env(GatewaySettings, anonymous), "compose-nats-anonymous"))
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=5) as r:
            assert r.status == 200
    finally:
        _stop(proc)


@pytest.mark.parametrize("password", ["-starts-with-a-dash", "12-digits-then-a-dash", "12345", "true"])
def test_compose_nats_takes_any_generated_password(tmp_path, password):
    """secrets-init's passwords are token_urlsafe: one in 64 starts with `-`, and some start with digits then
    `-`. nats-server parses an unquoted variable's value as configuration (an error, a number, a bool) and
    exits; compose's command quotes it, so each of these logs in."""
    secrets_dir = tmp_path / "secrets"
    assert secrets_init.main([str(secrets_dir)], environ={"PDSERVE_NATS_PASSWORD": password}) == 0
    port = free_port()
    script = _shell_script("nats").replace(
        "--config /etc/nats/pdserve.conf",
        f"--config {ROOT / 'docker' / 'nats.conf'} -p {port} -m {free_port()} -sd {tmp_path / 'js'}",
    )
    proc = _run_infra("nats", script, secrets_dir, port)
    try:
        env = {"PDSERVE_NATS_URL": f"nats://127.0.0.1:{port}", "PDSERVE_NATS_USER": "pdserve"}
        name = f"compose-nats-{password}"
        settings = from_env(GatewaySettings, env | {"PDSERVE_NATS_PASSWORD": password})
        assert asyncio.run(_nats_connects(settings, name)), bus.connection_problem(name)
    finally:
        _stop(proc)


async def _nats_connects(settings, name: str) -> bool:
    try:
        nc = await asyncio.wait_for(bus.connect(settings, name), 1.0)
    except TimeoutError:
        return False
    await nc.close()
    return True


def test_compose_redis_requires_the_password():
    """compose.yaml's redis command and healthcheck, run here (the image's entrypoint aside)."""
    port = free_port()
    script = _shell_script("redis").replace(
        "exec docker-entrypoint.sh redis-server -", f"exec redis-server - --port {port} --bind 127.0.0.1"
    )
    assert f"--port {port}" in script
    proc = _run_infra("redis", script, _local_secrets, port)
    try:
        env = environment("gateway") | {"PDSERVE_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
        assert asyncio.run(_redis_ping(from_env(GatewaySettings, env))) == "PONG"
        assert "refused the credentials" in asyncio.run(
            _redis_ping(from_env(GatewaySettings, env | {"PDSERVE_REDIS_PASSWORD": "wrong"}))
        )
        assert "refused the credentials" in asyncio.run(
            _redis_ping(from_env(GatewaySettings, {"PDSERVE_REDIS_URL": env["PDSERVE_REDIS_URL"]}))
        )
        check = SERVICES["redis"]["healthcheck"]["test"][1].replace("redis-cli ping", f"redis-cli -p {port} ping")
        check = interpolate(check).replace("$$", "$")  # what compose hands the container's shell
        assert subprocess.run(["sh", "-c", check.replace(SECRETS_MOUNT, str(_local_secrets))]).returncode == 0
        elsewhere = check.replace(SECRETS_MOUNT, str(_local_secrets / "missing"))
        assert subprocess.run(["sh", "-c", elsewhere], stderr=subprocess.DEVNULL).returncode != 0
    finally:
        _stop(proc)


async def _redis_ping(settings) -> str:
    client = redis_client(settings, socket_timeout=2.0)
    try:
        return "PONG" if await client.ping() else "no"
    except Exception as exc:
        return explain_redis_error(exc)
    finally:
        await client.aclose()


# ---- the ha profile: a 3-node NATS cluster, a Redis replica and 3 Sentinels ------------------------------

HA_ENV = dict(
    line.split("=", 1)
    for line in (ROOT / "docker" / "ha.env").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)  # what `docker compose --env-file docker/ha.env` interpolates with
NATS_NODES = ["nats", "nats-2", "nats-3"]
SENTINEL_SERVICES = ["sentinel-1", "sentinel-2", "sentinel-3"]


def test_ha_profile_adds_the_replicated_control_plane():
    assert HA_PROFILE == {"nats-2", "nats-3", "redis-replica", *SENTINEL_SERVICES}
    assert HA_ENV["COMPOSE_PROFILES"] == "ha"
    for name in HA_PROFILE:
        assert SERVICES[name]["restart"] == "unless-stopped", name
    # the NATS nodes: nats's image and command, a name each, the cluster's configuration (nats's too, with ha.env)
    assert [SERVICES[n]["environment"]["NATS_NODE"] for n in NATS_NODES] == NATS_NODES
    for name in NATS_NODES:
        assert (SERVICES[name]["image"], SERVICES[name]["command"]) == (SERVICES["nats"]["image"], command("nats"))
        assert "./docker/nats-cluster.conf:/etc/nats/pdserve.conf:ro" in interpolate(SERVICES[name]["volumes"], HA_ENV)
    assert set(re.findall(r"@([a-z0-9-]+):6222", _shell_script("nats"))) == set(NATS_NODES)  # the routes: all
    conf = (ROOT / "docker" / "nats-cluster.conf").read_text()
    for line in ("server_name: $PDSERVE_NATS_NODE", "routes: $PDSERVE_NATS_ROUTES", 'http: "127.0.0.1:8222"'):
        assert line in conf
    # Redis: the replica follows redis; both can follow a promoted one (masterauth); 3 Sentinels, quorum 2
    replica = _shell_script("redis-replica")
    assert "replicaof redis 6379" in replica and 'masterauth "$password"' in replica
    assert 'masterauth "$password"' in _shell_script("redis")
    for name in SENTINEL_SERVICES:
        script = _shell_script(name)
        assert "sentinel monitor pdserve redis 6379 2" in script and "port 26379" in script
        assert f"{SECRETS_MOUNT}/redis_password" in script and 'requirepass "$password"' in script
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert len({SERVICES[n]["environment"]["SENTINEL_NAME"] for n in SENTINEL_SERVICES}) == 3
    # with ha.env, every pdserve service is given the three nodes, R3 streams and the Sentinels
    for name in PDSERVE_SERVICES - ONE_SHOT:
        cls = GatewaySettings if role(name) == "gateway" else WorkerSettings
        kwargs = {} if cls is GatewaySettings else {"role": role(name)}
        settings = from_env(cls, environment(name, HA_ENV), **kwargs)
        assert settings.nats_url.split(",") == [f"nats://{n}:4222" for n in NATS_NODES], name
        assert settings.jetstream_replicas == len(NATS_NODES), name
        assert settings.redis_sentinels == tuple(f"{n}:26379" for n in SENTINEL_SERVICES), name
        assert settings.redis_sentinel_master == "pdserve", name


def test_compose_nats_cluster_forms(tmp_path):
    """compose.yaml's nats command and docker/nats-cluster.conf, three of them run here (each node's name, routes
    with the password, JetStream), the compose names swapped for loopback ports: the cluster forms and the
    services' settings (with ha.env) make their streams at 3 replicas across it."""
    ports = {name: (free_port(), free_port(), free_port()) for name in NATS_NODES}  # client, route, monitor
    procs = []
    try:
        for name in NATS_NODES:
            client, route, monitor = ports[name]
            script = f"export NATS_NODE={name}\n" + _shell_script(name)
            for other in NATS_NODES:
                script = script.replace(f"@{other}:6222", f"@127.0.0.1:{ports[other][1]}")
            conf = ROOT / "docker" / "nats-cluster.conf"
            script = script.replace(
                "--config /etc/nats/pdserve.conf",
                f"--config {conf} -p {client} -m {monitor} --cluster nats://127.0.0.1:{route} -sd {tmp_path / name}",
            )
            procs.append(_run_infra(name, script, _local_secrets, client))
        for _, _, monitor in ports.values():  # routed, and JetStream's meta group current on every node
            _wait_ok(f"http://127.0.0.1:{monitor}/healthz")
        urls = ",".join(f"nats://127.0.0.1:{client}" for client, _, _ in ports.values())
        settings = from_env(GatewaySettings, environment("gateway", HA_ENV) | {"PDSERVE_NATS_URL": urls})
        assert asyncio.run(_replicated_streams(settings)) == 3
    finally:
        for proc in procs:
            _stop(proc)


async def _replicated_streams(settings) -> int:
    nc = await bus.connect(settings, "compose-ha")
    try:
        js = nc.jetstream(timeout=5)
        for _ in range(100):  # the meta leader may still be settling
            try:
                await bus.ensure_streams(js, settings.jetstream_replicas)
                break
            except Exception:
                await asyncio.sleep(0.2)
        return (await js.stream_info("PD_JOBS")).config.num_replicas
    finally:
        await nc.close()


def _wait_ok(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} not ok after {timeout_s:g} s"
        time.sleep(0.2)


def test_compose_redis_replica_and_sentinel_run(tmp_path):
    """compose.yaml's redis, redis-replica and sentinel-1 commands run here (compose names swapped for loopback
    ports): the replica syncs with the password, the Sentinel takes its configuration, sees the replica, and the
    services' settings (with ha.env) reach the primary through it; its healthcheck passes."""
    primary_port, replica_port, sentinel_port = free_port(), free_port(), free_port()

    def node(name: str, port: int) -> str:
        script = _shell_script(name).replace(
            "exec docker-entrypoint.sh redis-server -", f"exec redis-server - --port {port} --bind 127.0.0.1"
        )
        return re.sub(r"replica-announce-ip \S+", "replica-announce-ip 127.0.0.1", script).replace(
            "replicaof redis 6379", f"replicaof 127.0.0.1 {primary_port}"
        )

    sentinel = (
        _shell_script("sentinel-1")
        .replace("/data/sentinel.conf", str(tmp_path / "sentinel.conf"))
        .replace("exec docker-entrypoint.sh redis-server", "exec redis-server")
        .replace("port 26379", f"port {sentinel_port}\nbind 127.0.0.1")
        .replace("sentinel monitor pdserve redis 6379 2", f"sentinel monitor pdserve 127.0.0.1 {primary_port} 1")
    )
    procs = []
    try:
        procs.append(_run_infra("redis", node("redis", primary_port), _local_secrets, primary_port))
        procs.append(_run_infra("redis-replica", node("redis-replica", replica_port), _local_secrets, replica_port))
        sentinel = "export SENTINEL_NAME=127.0.0.1\n" + sentinel
        procs.append(_run_infra("sentinel-1", sentinel, _local_secrets, sentinel_port))
        password = _secret("redis_password")
        deadline = time.monotonic() + 30
        while True:  # the Sentinel learns the replica from the primary
            with contextlib.closing(redis_lib.Redis(port=sentinel_port, password=password, socket_timeout=2)) as r:
                if r.sentinel_master("pdserve")["num-slaves"] == 1:
                    break
            assert time.monotonic() < deadline, "the Sentinel never saw the replica"
            time.sleep(0.2)
        shell = HA_ENV | {"REDIS_SENTINELS": f"127.0.0.1:{sentinel_port}"}
        settings = from_env(GatewaySettings, environment("gateway", shell))
        assert asyncio.run(_redis_ping(settings)) == "PONG"
        check = SERVICES["sentinel-1"]["healthcheck"]["test"][1].replace("-p 26379", f"-p {sentinel_port}")
        check = interpolate(check).replace("$$", "$").replace(SECRETS_MOUNT, str(_local_secrets))
        assert subprocess.run(["sh", "-c", check]).returncode == 0
    finally:
        for proc in reversed(procs):
            _stop(proc)


# ---- the observability profile: Jaeger, Prometheus, Grafana ----------------------------------------------


def _published(name: str) -> tuple[str, int]:
    """The one published port of a service with nothing set: (host address, container port)."""
    ports = interpolate(SERVICES[name]["ports"])
    assert len(ports) == 1, name
    host_part, _, container_port = str(ports[0]).rpartition(":")
    return host_part, int(container_port)


def _worker_metrics_port() -> int:
    ports = {from_env(WorkerSettings, environment(n), role=role(n)).metrics_port for n in WORKERS}
    assert len(ports) == 1, f"workers serve /metrics on different ports: {ports}"
    return ports.pop()


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", duration).groups()
    return int(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def _mounts(name: str) -> dict[str, str]:
    """Container path → repository path of a service's bind mounts of repository files (all read-only)."""
    mounts = {}
    for mount in interpolate(SERVICES[name].get("volumes", [])):
        source, target, *mode = str(mount).split(":")
        if source.startswith("./"):
            assert mode == ["ro"], f"{name}: mount {source} read-only"
            mounts[target] = source
    return mounts


def _load_yaml(relative: str):
    return yaml.safe_load((ROOT / relative).read_text())


def test_observability_services_run_only_in_their_profile():
    assert OBSERVABILITY == {"jaeger", "prometheus", "grafana"}
    for name in OBSERVABILITY:
        svc = SERVICES[name]
        assert svc["profiles"] == ["observability"], name
        assert svc["restart"] == "unless-stopped", name
        assert ":" in svc["image"] and not svc["image"].endswith(":latest"), f"{name}: pin the image"
    assert SERVICES["jaeger"]["image"].startswith("jaegertracing/all-in-one:1.")
    assert SERVICES["prometheus"]["image"].startswith("prom/prometheus:v3.")
    assert re.match(r"grafana/grafana:1[12]\.", SERVICES["grafana"]["image"])
    # nothing outside the profile needs it (a dependency would start it, or fail without the profile)
    for name, svc in SERVICES.items():
        if name not in OBSERVABILITY:
            assert not set(svc.get("depends_on", {})) & OBSERVABILITY, name
    assert SERVICES["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_observability_uis_are_published_on_loopback_by_default():
    for name, variable, port in (("jaeger", "JAEGER", 16686), ("prometheus", "PROMETHEUS", 9090),
                                 ("grafana", "GRAFANA", 3000)):  # fmt: skip
        assert SERVICES[name]["ports"] == [f"${{{variable}_PUBLISH:-127.0.0.1:{port}}}:{port}"], name
        assert _published(name) == (f"127.0.0.1:{port}", port)
    grafana = environment("grafana")
    assert environment("grafana", {"GRAFANA_ADMIN_PASSWORD": "s3cret"})["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "admin"
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    header = (ROOT / "compose.yaml").read_text().split("\nx-pdserve")[0]
    for variable in ("JAEGER_PUBLISH", "PROMETHEUS_PUBLISH", "GRAFANA_PUBLISH", "GRAFANA_ADMIN_PASSWORD",
                     "OTEL_EXPORTER_OTLP_ENDPOINT", "--profile observability"):  # fmt: skip
        assert variable in header, f"the header comment of compose.yaml does not mention {variable}"


def test_observability_healthchecks():
    assert SERVICES["prometheus"]["healthcheck"]["test"] == [
        "CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{_published('prometheus')[1]}/-/ready"
    ]  # fmt: skip
    assert SERVICES["grafana"]["healthcheck"]["test"] == [
        "CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{_published('grafana')[1]}/api/health"
    ]  # fmt: skip
    # Jaeger's binary checks its own admin port (`status`): the image needs no shell tool for it.
    assert SERVICES["jaeger"]["healthcheck"]["test"] == ["CMD", "/go/bin/all-in-one-linux", "status"]


def test_traces_reach_jaeger_when_asked():
    otlp_ports = {"grpc": 4317, "http/protobuf": 4318}
    jaeger = environment("jaeger")
    assert jaeger["COLLECTOR_OTLP_ENABLED"] == "true"
    assert jaeger["COLLECTOR_OTLP_GRPC_HOST_PORT"] == "0.0.0.0:4317"
    assert jaeger["COLLECTOR_OTLP_HTTP_HOST_PORT"] == "0.0.0.0:4318"
    command_line = "OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318 docker compose --profile observability up"
    assert command_line in (ROOT / "README.md").read_text()
    assert command_line in (ROOT / "compose.yaml").read_text()
    shell = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}
    for name in PDSERVE_SERVICES - ONE_SHOT:
        env = environment(name)
        assert set(env) >= OTEL_VARS, name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "" and exporters_wanted(env) == [], f"{name}: tracing is off"
        env = environment(name, shell)
        assert exporters_wanted(env) == ["otlp"], name
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", env["OTEL_EXPORTER_OTLP_ENDPOINT"]).groups()
        assert host in OBSERVABILITY and int(port) == otlp_ports[env["OTEL_EXPORTER_OTLP_PROTOCOL"]], name


def test_workers_serve_metrics_on_the_compose_network():
    for name in WORKERS:
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        assert settings.metrics_host == "0.0.0.0", f"{name}: Prometheus scrapes from another container"
        assert settings.metrics_port == 9100, name
    assert _worker_metrics_port() == 9100


def test_prometheus_scrapes_every_pdserve_service():
    mounts = _mounts("prometheus")
    config_flag = next(a for a in SERVICES["prometheus"]["command"] if a.startswith("--config.file="))
    config_path = mounts[config_flag.removeprefix("--config.file=")]
    assert config_path == "./docker/observability/prometheus.yml"
    config = _load_yaml(config_path)
    interval, timeout = config["global"]["scrape_interval"], config["global"]["scrape_timeout"]
    assert interval == "5s" and _seconds(timeout) <= _seconds(interval)
    # What the formats Prometheus asks for make of a `pdserve:` name (Accept headers as Prometheus 3 sends them).
    accept = {
        "PrometheusText0.0.4": "text/plain;version=0.0.4",
        "PrometheusText1.0.0": "text/plain;version=1.0.0;escaping=allow-utf-8",
        "OpenMetricsText0.0.1": "application/openmetrics-text;version=0.0.1",
        "OpenMetricsText1.0.0": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    }
    registry = CollectorRegistry()
    Counter("pdserve:probe", "A probe.", registry=registry).inc()
    for protocol in config["global"]["scrape_protocols"]:
        encoder, _content_type = choose_encoder(accept[protocol])
        assert "\npdserve:probe_total 1.0\n" in encoder(registry).decode(), protocol
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "prefill", "decode"}
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())

    gateway_port = from_env(GatewaySettings, environment("gateway")).port
    (static,) = jobs["gateway"]["static_configs"]
    assert static["targets"] == [f"gateway:{gateway_port}"]
    assert "dns_sd_configs" not in jobs["gateway"]

    for job_role in ("prefill", "decode"):
        job = jobs[job_role]
        assert "static_configs" not in job, f"{job_role}: workers scale, so find them in DNS"
        (sd,) = job["dns_sd_configs"]
        assert sd["type"] == "A" and sd["port"] == _worker_metrics_port(), job_role
        # every worker service of the role, CPU and gpu profile, and nothing else
        assert set(sd["names"]) == {name for name in WORKERS if role(name) == job_role}, job_role


def test_grafana_provisioning():
    mounts = _mounts("grafana")
    assert mounts == {
        "/etc/grafana/provisioning": "./docker/observability/grafana/provisioning",
        "/var/lib/grafana/dashboards": "./docker/observability/grafana/dashboards",
    }
    provisioning = OBSERVABILITY_DIR / "grafana" / "provisioning"
    datasources = {}
    for path in sorted((provisioning / "datasources").glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == 1, path
        datasources |= {ds["uid"]: ds for ds in doc["datasources"]}
    assert set(datasources) == {"prometheus", "jaeger"}
    for uid, service in (("prometheus", "prometheus"), ("jaeger", "jaeger")):
        ds = datasources[uid]
        assert ds["type"] == uid and ds["access"] == "proxy"
        # the service's own (container) port on the compose network
        assert ds["url"] == f"http://{service}:{_published(service)[1]}", uid
    assert [uid for uid, ds in datasources.items() if ds.get("isDefault")] == ["prometheus"]

    providers = []
    for path in sorted((provisioning / "dashboards").glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == 1, path
        providers += doc["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
    assert all(p["type"] == "file" for p in providers)
    home = environment("grafana")["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/pdserve.json"


def test_observability_mounts_exist():
    for name in SERVICES:
        for source in _mounts(name).values():
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
    assert (ROOT / "docker/observability/grafana/dashboards/pdserve.json").is_file()


def _dashboard() -> dict:
    return json.loads((OBSERVABILITY_DIR / "grafana" / "dashboards" / "pdserve.json").read_text())


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _exposition() -> dict[str, set[str]]:
    """Every series name shared.telemetry.metrics exposes → the labels it carries."""
    names = {}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    for collector in vars(metrics).values():
        if isinstance(collector, (metrics.Counter, metrics.Gauge, metrics.Histogram)):
            (family,) = collector.describe()
            labels = set(collector._labelnames)  # no public accessor
            for suffix in suffixes[family.type]:
                names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    assert len(names) > 20
    return names


def test_dashboard_panels_query_prometheus():
    dashboard = _dashboard()
    assert dashboard["uid"] == "pdserve" and dashboard["title"] == "pdserve"
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["definition"] == "label_values(pdserve:generation_tokens_total, model_name)"
    ids = []
    queries = 0
    for panel in _panels(dashboard["panels"]):
        ids.append(panel["id"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel.get("datasource") == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
            assert 'model_name=~"$model_name"' in target["expr"], f"{panel['title']}: {target['expr']}"
            queries += 1
    assert len(ids) == len(set(ids))
    assert queries >= 25
    titles = {p["title"] for p in _panels(dashboard["panels"])}
    for expected in ("Time to first token", "Time per output token", "Inter-token latency", "End-to-end latency",
                     "Queue time by role", "KV cache usage", "KV transfer time", "KV transfer bandwidth",
                     "KV transfer failures", "Expert load: layer × expert"):  # fmt: skip
        assert expected in titles


def test_dashboard_metrics_exist():
    """Every pdserve: series the dashboard queries is one the code exposes, selected by labels it has: a
    renamed metric or label fails here."""
    exposed = _exposition()
    dashboard = _dashboard()
    text = json.dumps(dashboard)
    used = set(re.findall(r"pdserve:[a-z0-9_]+", text))
    assert used and used <= set(exposed), sorted(used - set(exposed))
    extra_labels = {"instance", "job", "service"}  # added by Prometheus (docker/observability/prometheus.yml)
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    for expr in exprs:
        for name, selector in re.findall(r"(pdserve:[a-z0-9_]+)(?:\{([^}]*)\})?", expr):
            selected = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
            assert selected <= exposed[name], f"{expr}: {selected - exposed[name]}"
        labels = exposed[re.search(r"pdserve:[a-z0-9_]+", expr).group()] | extra_labels
        for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in grouping.split(",")}
            assert grouped <= labels, f"{expr}: {grouped - labels}"
    # the panels the issue asks for
    for metric in ("time_to_first_token_seconds_bucket", "request_time_per_output_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "request_queue_time_seconds_bucket", "request_success_total", "generation_tokens_total",
                   "prompt_tokens_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "kv_transfer_seconds_bucket", "kv_transfer_bytes_total", "kv_transfer_failures_total",
                   "moe_expert_tokens_total"):  # fmt: skip
        assert f"pdserve:{metric}" in used, metric


# ---- Dockerfile -----------------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_contract():
    instructions = _instructions()
    final = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    assert final[0] == ("FROM", "python:3.11-slim")
    ops = dict(final)
    assert json.loads(ops["ENTRYPOINT"]) == ["pdserve"]
    assert ops["USER"] not in ("root", "0")
    assert ("ARG", 'TORCH_INDEX_URL=""') in instructions
    # no package host is written into the build: indexes come from build args or pip's own configuration
    for op, rest in instructions:
        assert "://" not in rest, f"{op} {rest}"
    # the helpers compose calls are installed under the names it uses
    body = " ".join(rest for _, rest in instructions)
    assert "docker/healthcheck.py /opt/venv/bin/pdserve-healthcheck" in body
    assert "docker/model-init.sh /opt/venv/bin/pdserve-model-init" in body
    assert "docker/secrets_init.py /opt/venv/bin/pdserve-secrets-init" in body
    # the CPU expert kernel is compiled at build time into the cache the runtime (no compiler) reads
    kernels = "PDSERVE_KERNEL_CACHE=/opt/venv/share/pdserve/kernels"
    assert f"RUN {kernels} python -c" in " ".join(f"{op} {rest}" for op, rest in instructions)
    assert kernels in ops["ENV"]
    # the secrets volume starts out as the image's directory: the pdserve user's, private
    assert f"chown pdserve:pdserve /models {SECRETS_MOUNT}" in body and f"chmod 0700 {SECRETS_MOUNT}" in body


def test_dockerignore_keeps_the_context_small():
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert patterns[patterns.index("*") :]  # everything excluded, then re-included by name
    for needed in ("!pyproject.toml", "!README.md", "!shared/", "!services/", "!docker/"):
        assert needed in patterns


# ---- docker/healthcheck.py, for real --------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck():
    module = _load_script("pdserve_healthcheck", "docker/healthcheck.py")
    module.TIMEOUT_S = 1.5
    return module


def test_healthcheck_usage(healthcheck):
    assert healthcheck.main([]) == 2
    assert healthcheck.main(["nats"]) == 2


def test_healthcheck_gateway(healthcheck, monkeypatch):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PDSERVE_PORT", str(server.server_address[1]))
        assert healthcheck.main(["gateway"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main(["gateway"]) == 1  # nothing listens there any more


def test_healthcheck_worker_heartbeats(healthcheck, monkeypatch):
    import nats

    from services.local.infra import start_nats
    from shared.messages import Heartbeat, encode, heartbeat_subject

    server = start_nats()
    monkeypatch.setenv("PDSERVE_NATS_URL", server.url)
    monkeypatch.delenv("PDSERVE_WORKER_ID", raising=False)
    mine = f"worker-{socket.gethostname()}-abc123"

    async def check_while_beating(role: str, worker_id: str) -> bool:
        nc = await nats.connect(server.url)

        async def beat() -> None:
            while True:
                hb = Heartbeat(worker_id=worker_id, role="prefill", model="demo", rpc_address=None)
                await nc.publish(heartbeat_subject("prefill", worker_id), encode(hb))
                await asyncio.sleep(0.1)

        task = asyncio.create_task(beat())
        try:
            return await healthcheck.check_worker(role)
        finally:
            task.cancel()
            await nc.close()

    try:
        assert asyncio.run(check_while_beating("prefill", mine))
        # its beat as another role: the container's worker switched role (it started as a decode worker): healthy
        assert asyncio.run(check_while_beating("decode", mine))
        assert not asyncio.run(check_while_beating("prefill", "worker-elsewhere-abc123"))  # another container's
        monkeypatch.setenv("PDSERVE_WORKER_ID", "worker-elsewhere-abc123")
        assert asyncio.run(check_while_beating("prefill", "worker-elsewhere-abc123"))  # an explicit id
    finally:
        server.stop()
    assert healthcheck.main(["prefill"]) == 1  # NATS is gone


def test_healthcheck_logs_in_as_the_services_do(healthcheck, monkeypatch, tmp_path, capsys):
    """Credentials from the same PDSERVE_* settings (here the _FILE form compose uses); a wrong password is
    unhealthy, with the reason."""
    from services.local.infra import start_nats

    server = start_nats(user="pdserve", password="right-one")
    password_file = tmp_path / "nats_password"
    password_file.write_text("right-one\n")
    monkeypatch.setenv("PDSERVE_NATS_URL", f"nats://127.0.0.1:{server.port}")  # no credentials in the URL
    monkeypatch.setenv("PDSERVE_NATS_USER", "pdserve")
    monkeypatch.setenv("PDSERVE_NATS_PASSWORD_FILE", str(password_file))
    monkeypatch.setenv("PDSERVE_WORKER_ID", "worker-x")
    try:
        assert asyncio.run(_check_while_beating(healthcheck, server.url, "decode", "worker-x"))
        password_file.write_text("wrong\n")
        capsys.readouterr()
        assert healthcheck.main(["decode"]) == 1
        assert "refused the credentials" in capsys.readouterr().err
    finally:
        server.stop()


async def _check_while_beating(healthcheck, url: str, role: str, worker_id: str) -> bool:
    import nats

    from shared.messages import Heartbeat, encode, heartbeat_subject

    nc = await nats.connect(url)

    async def beat() -> None:
        while True:
            hb = Heartbeat(worker_id=worker_id, role=role, model="demo", rpc_address=None)
            await nc.publish(heartbeat_subject(role, worker_id), encode(hb))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        return await healthcheck.check_worker(role)
    finally:
        task.cancel()
        await nc.close()


def _stage(name: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions from `FROM ... AS name` to the next FROM."""
    instructions = _instructions()
    start = next(i for i, (op, rest) in enumerate(instructions) if op == "FROM" and rest.endswith(f" AS {name}"))
    end = next((i for i in range(start + 1, len(instructions)) if instructions[i][0] == "FROM"), len(instructions))
    return instructions[start:end]


def test_gateway_image_has_no_torch():
    """The gateway's image installs the gateway's dependencies (pinned as pyproject.toml pins them) and pdserve
    without its dependencies; they cover every distribution the gateway imports, and torch is none of them."""
    build = " ".join(rest for _, rest in _stage("gateway-build"))
    assert "deps.py /tmp/build/pyproject.toml --gateway" in build and "pip install --no-deps /tmp/src" in build
    assert "docker/healthcheck.py /opt/venv/bin/pdserve-healthcheck" in build
    gateway = dict(_stage("gateway"))
    assert json.loads(gateway["ENTRYPOINT"]) == ["pdserve-gateway"] and gateway["USER"] not in ("root", "0")
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "deps.py"), str(ROOT / "pyproject.toml"), "--gateway"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pins = out.stdout.split()
    names = {canonicalize_name(Requirement(pin).name) for pin in pins}
    assert not names & {"torch", "triton", "numpy"}, names
    installed = _with_requirements(names)
    assert not installed & {"torch", "triton"}, installed
    needed = _gateway_distributions()
    assert needed and needed <= installed, f"the gateway imports {sorted(needed - installed)}, which its image lacks"


def _gateway_distributions() -> set[str]:
    """The distributions whose modules the gateway loads (in a fresh interpreter) from the third-party packages
    pdserve's own code imports (a library's optional imports of what happens to be installed here are not
    needed); a module's distribution is the one whose files hold it."""
    graph = grimp.build_graph("shared", "services", include_external_packages=True, cache_dir=None)
    gateway = [m for m in graph.modules if m.startswith("services.gateway")]
    upstream = set().union(*(graph.find_upstream_modules(m) for m in gateway))
    direct = {m for m in upstream if not m.startswith(("shared", "services"))} - set(sys.stdlib_module_names)
    code = (
        "import sys, services.gateway.app, services.gateway.main\n"
        "for name, module in list(sys.modules.items()):\n"
        "    print(name, getattr(module, '__file__', None))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    loaded = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    owner = {
        str(Path(str(dist.locate_file(f))).resolve()): canonicalize_name(dist.metadata["Name"])
        for dist in importlib.metadata.distributions()
        for f in dist.files or []
        if f.suffix in (".py", ".so")
    }
    files = {str(Path(f).resolve()) for m, f in loaded.items() if m.split(".")[0] in direct and f != "None"}
    return {owner[f] for f in files if f in owner}


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and every distribution they require here (no extras), as pip would install them."""
    seen, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for req in map(Requirement, importlib.metadata.requires(name) or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


# ---- docker/compose_autoscale.py: --scale from the planner's desired counts, for real ------------------------------


PLANNER_METRIC = "pdserve:planner_desired_workers"  # the planner's desired worker count per role (label `role`)


@pytest.fixture(scope="module")
def autoscale():
    return _load_script("pdserve_compose_autoscale", "docker/compose_autoscale.py")


def _planner_exposition(counts: dict[str, float]) -> bytes:
    """What a planner serves: the desired count per role (labels model_name and role), with other series around."""
    registry = CollectorRegistry()
    gauge = Gauge(PLANNER_METRIC, "Workers the planner wants.", ("model_name", "role"), registry=registry)
    for worker_role, count in counts.items():
        gauge.labels("demo", worker_role).set(count)
    Counter("pdserve:requests", "Other series.", ("role",), registry=registry).labels("prefill").inc()
    encoder, _ = choose_encoder("text/plain;version=0.0.4")
    return encoder(registry)


def test_compose_autoscale_follows_the_planner(autoscale, tmp_path, monkeypatch):
    """The script reads the counts from a planner's /metrics over HTTP and runs `docker compose up --scale` (a
    stand-in `docker` on PATH records it) when they change; within 1..--max; nothing while the planner is away."""
    assert autoscale.METRIC == PLANNER_METRIC
    served = {"body": _planner_exposition({"prefill": 3, "decode": 2})}

    class Planner(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(served["body"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Planner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    calls = tmp_path / "calls"
    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{docker.parent}:{os.environ['PATH']}")
    try:
        assert autoscale.main([url, "--once"]) == 0
        assert calls.read_text().splitlines() == [
            "compose up -d --no-recreate --scale prefill=3 --scale decode=2 prefill decode"
        ]
        served["body"] = _planner_exposition({"prefill": 0, "decode": 20})  # kept within 1..--max
        assert autoscale.main([url, "--once", "--max", "6"]) == 0
        assert calls.read_text().splitlines()[-1].endswith("--scale prefill=1 --scale decode=6 prefill decode")
        served["body"] = _planner_exposition({"decode": 2})  # no count for prefill: nothing changes
        assert autoscale.main([url, "--once"]) == 1 and len(calls.read_text().splitlines()) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert autoscale.main([url, "--once"]) == 1 and len(calls.read_text().splitlines()) == 2  # the planner is gone
    # a round with the counts already applied runs nothing
    ran: list[list[str]] = []
    applied = autoscale.step({"prefill": 2, "decode": 1}, None, 8, lambda c: ran.append(c) or 0)
    assert autoscale.step({"prefill": 2, "decode": 1}, applied, 8, lambda c: ran.append(c) or 0) == applied
    assert len(ran) == 1
    assert autoscale.step({"prefill": 5, "decode": 1}, applied, 8, lambda c: 1) == applied  # compose failed: retried
    assert autoscale.desired('pdserve:planner_desired_workers{role="decode",model_name="a"} 2.5\n') == {"decode": 3}
