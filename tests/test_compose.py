"""The Docker deployment's contract, checked without Docker: compose.yaml and the Dockerfile must agree
with the code (settings fields, `pdserve` subcommands) and with what `docker compose up` needs (health
checks, start order, scalable workers, GPU reservations). docker/healthcheck.py runs for real against a
local NATS."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from services.cli import main as cli_main
from shared.settings import GatewaySettings, WorkerSettings, from_env

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
BUILDERS = [name for name, svc in SERVICES.items() if "build" in svc]
PDSERVE_SERVICES = {name for name, svc in SERVICES.items() if svc.get("image") == SERVICES[BUILDERS[0]]["image"]}
ONE_SHOT = {name for name, svc in SERVICES.items() if svc.get("restart") == "no"}
GPU_PROFILE = {name for name, svc in SERVICES.items() if "gpu" in svc.get("profiles", [])}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value):
    """What compose makes of a value when no variable is set: ${VAR:-default} → default, ${VAR} → ''."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def command(name: str) -> list[str]:
    cmd = SERVICES[name].get("command", [])
    assert isinstance(cmd, list), f"{name}: use the exec (list) form for command"
    return cmd


def role(name: str) -> str | None:
    """The `pdserve` subcommand a long-running pdserve service runs."""
    if name not in PDSERVE_SERVICES or name in ONE_SHOT:
        return None
    return command(name)[0]


WORKERS = {name for name in PDSERVE_SERVICES if role(name) in ("prefill", "decode", "mixed")}


def environment(name: str) -> dict[str, str]:
    env = SERVICES[name].get("environment", {})
    assert isinstance(env, dict), f"{name}: use the mapping form for environment"
    return {k: str(v) for k, v in interpolate(env).items()}


def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# ---- compose.yaml ---------------------------------------------------------------------------------------


def test_expected_services_exist():
    assert {"nats", "redis", "model-init", "gateway", "prefill", "decode", "prefill-gpu", "decode-gpu"} <= set(SERVICES)
    assert ONE_SHOT == {"model-init"}
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


def test_infrastructure_healthchecks():
    nats = SERVICES["nats"]
    assert nats["image"].startswith("nats:") and nats["image"].endswith("-alpine")
    assert "--jetstream" in command("nats") or "-js" in command("nats")
    assert any("/healthz?js-enabled-only=true" in part for part in nats["healthcheck"]["test"])
    monitor_port = command("nats")[command("nats").index("--http_port") + 1]
    assert f"127.0.0.1:{monitor_port}/healthz" in " ".join(nats["healthcheck"]["test"])
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


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


def test_gateway_publishes_8000():
    ports = interpolate(SERVICES["gateway"]["ports"])
    assert len(ports) == 1
    host_part, _, container_port = str(ports[0]).rpartition(":")
    assert container_port == "8000"
    assert host_part.rpartition(":")[2] == "8000"
    assert from_env(GatewaySettings, environment("gateway")).port == 8000


def test_workers_scale():
    for name in WORKERS:
        svc = SERVICES[name]
        for key in ("container_name", "ports", "hostname"):
            assert key not in svc, f"{name}: {key} prevents --scale"


def test_prefill_workers_advertise_a_reachable_address():
    for name in WORKERS:
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        if settings.role == "prefill":
            # The wildcard makes the transfer server advertise the container's hostname (a loopback
            # address would send decode workers to themselves).
            assert settings.rpc_host == "0.0.0.0", name
            assert settings.rpc_port != 0, f"{name}: a fixed port inside the container"


def test_gpu_profile_reserves_disjoint_gpus():
    ids: dict[str, set[str]] = {}
    for name in GPU_PROFILE:
        svc = SERVICES[name]
        assert "deploy" not in SERVICES[name.removesuffix("-gpu")], "CPU workers reserve no GPU"
        devices = interpolate(svc["deploy"]["resources"]["reservations"]["devices"])
        assert devices and all("gpu" in d["capabilities"] for d in devices), name
        ids[role(name)] = {str(i) for d in devices for i in d["device_ids"]}
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        assert settings.device == "cuda" and settings.transfer_backend == "nccl", name
    assert set(ids) == {"prefill", "decode"}
    assert ids["prefill"] and ids["decode"] and not ids["prefill"] & ids["decode"]
    for name in WORKERS - GPU_PROFILE:
        settings = from_env(WorkerSettings, environment(name), role=role(name))
        assert settings.device == "cpu" and settings.transfer_backend == "gloo", name


def test_models_volume_is_mounted_everywhere_it_is_read():
    assert "models" in COMPOSE["volumes"]
    for name in PDSERVE_SERVICES:
        mounts = [str(m) for m in interpolate(SERVICES[name]["volumes"])]
        models = [m for m in mounts if m.split(":")[1] == "/models"]
        assert models, f"{name} does not mount /models"
        source, _, rest = models[0].partition(":")
        assert source == "models", name
        read_only = rest.endswith(":ro")
        assert read_only == (name not in ONE_SHOT), f"{name}: only model-init writes checkpoints"
        model = environment(name)["PDSERVE_MODEL"]
        assert model.startswith("/models/"), name
    assert len({environment(n)["PDSERVE_MODEL"] for n in PDSERVE_SERVICES}) == 1


def test_environment_names_are_settings_fields():
    gateway_fields, worker_fields = field_names(GatewaySettings), field_names(WorkerSettings)
    for name in PDSERVE_SERVICES:
        fields = gateway_fields if role(name) == "gateway" else worker_fields
        for var in environment(name):
            assert var.startswith("PDSERVE_"), f"{name}: {var}"
            assert var.removeprefix("PDSERVE_").lower() in fields, f"{name}: {var} is no settings field"
    # ... and every PDSERVE_* variable the file interpolates from the user's shell is one too.
    all_fields = gateway_fields | worker_fields
    for var in re.findall(r"\$\{(PDSERVE_[A-Z0-9_]+)", (ROOT / "compose.yaml").read_text()):
        assert var.removeprefix("PDSERVE_").lower() in all_fields, var


def test_environment_values_parse():
    """With nothing set in the shell, every service's environment builds valid settings."""
    for name in PDSERVE_SERVICES - ONE_SHOT:
        if role(name) == "gateway":
            settings = from_env(GatewaySettings, environment(name))
            assert settings.api_keys == ()
        else:
            settings = from_env(WorkerSettings, environment(name), role=role(name))
            assert settings.threads and settings.dtype is None
        assert settings.nats_url == "nats://nats:4222" and settings.redis_url.startswith("redis://redis:6379")
        assert settings.model_name is None and settings.served_model_name == "demo"


def _help_exits_cleanly(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main([*argv, "--help"])
    assert exc.value.code == 0, argv


def test_commands_are_pdserve_subcommands(capsys):
    for name in PDSERVE_SERVICES - ONE_SHOT:
        assert "entrypoint" not in SERVICES[name], f"{name} runs the image's entrypoint, pdserve"
        _help_exits_cleanly(command(name))
    # model-init passes its command on to `pdserve demo-model <dir>`
    assert SERVICES["model-init"]["entrypoint"] == ["pdserve-model-init"]
    _help_exits_cleanly(["demo-model", "/models/demo", *command("model-init")])
    assert 'pdserve demo-model "$tmp" "$@"' in (ROOT / "docker" / "model-init.sh").read_text()
    capsys.readouterr()


def test_one_image_built_once():
    # One service builds the image (building it in several races in some compose versions); all the
    # others wait for that one, so the image exists before compose looks for it.
    assert BUILDERS == ["model-init"]
    build = SERVICES["model-init"]["build"]
    assert build["context"] == "."
    args = set(re.findall(r"^ARG (\w+)", (ROOT / "Dockerfile").read_text(), re.M))
    assert set(build.get("args", {})) <= args
    assert SERVICES["model-init"]["image"] == "pdserve:latest"
    for name in PDSERVE_SERVICES - ONE_SHOT:
        assert "model-init" in SERVICES[name]["depends_on"], name


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


def test_dockerignore_keeps_the_context_small():
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert patterns[patterns.index("*") :]  # everything excluded, then re-included by name
    for needed in ("!pyproject.toml", "!README.md", "!shared/", "!services/", "!docker/"):
        assert needed in patterns


# ---- docker/healthcheck.py, for real --------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck", ROOT / "docker" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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

    from shared.messages import Heartbeat, encode, heartbeat_subject
    from shared.procs import start_nats

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
        assert not asyncio.run(check_while_beating("decode", mine))  # another role's beat
        assert not asyncio.run(check_while_beating("prefill", "worker-elsewhere-abc123"))  # another container's
        monkeypatch.setenv("PDSERVE_WORKER_ID", "worker-elsewhere-abc123")
        assert asyncio.run(check_while_beating("prefill", "worker-elsewhere-abc123"))  # an explicit id
    finally:
        server.stop()
    assert healthcheck.main(["prefill"]) == 1  # NATS is gone
