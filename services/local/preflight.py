"""What `pdserve up` checks before it starts anything: a configuration that every service would refuse is said
once, within seconds, and nothing is started — not services that exit with it one after another and are
restarted until the supervisor gives up.

  - the checkpoint: its config.json loads as a model config (shared/model/config.py, the loader every service
    uses); the weights are left to the workers (a worker that cannot load them refuses: exit status 2, which the
    supervisor does not restart either);
  - the settings: the gateway's from PDSERVE_* variables, and each role's from them and its flags (worker_args,
    --<role>-args), parsed and validated as the services will; the planner's (--planner-args) with --planner;
  - the ports `pdserve up` binds itself or names: the gateway's, the supervisor's /metrics (when not 0).

Each failure is a ValueError (or the loader's FileNotFoundError / PermissionError) whose message is the one line
to print.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Mapping, Sequence

from services.local.stack import StackSpec
from shared.model.config import ModelConfig
from shared.settings import GatewaySettings, from_env

# role, its flags (those of the spec: the user's), the environment → the role's settings, or a ValueError
WorkerSettingsParser = Callable[[str, Sequence[str], Mapping[str, str]], object]


def preflight(
    spec: StackSpec,
    parse_worker: WorkerSettingsParser,
    ports: Sequence[tuple[int, str]] = (),
    parse_planner: Callable[[Sequence[str], Mapping[str, str]], object] | None = None,
) -> None:
    """Raise (see the module docstring) unless the stack's configuration passes what can be checked now. `ports`:
    (port, the flag that chose it) on spec.host, beside the gateway's (spec.port); a 0 is skipped. parse_planner:
    the planner's flags and environment → its settings (with spec.planner)."""
    check_checkpoint(spec.model)
    environ = dict(os.environ) | spec.env  # what every service's environment starts from (Stack.service_env)
    if "PDSERVE_CLUSTER_SECRET_FILE" not in environ:  # the stack makes one unless the user names theirs
        environ = {"PDSERVE_CLUSTER_SECRET": "made-by-the-stack"} | environ
    try:
        from_env(GatewaySettings, environ, model=spec.model, port=spec.port, host=spec.host)
    except ValueError as exc:
        raise ValueError(f"the gateway's settings: {exc}") from exc
    for role in dict.fromkeys(spec.roles()):
        parse_worker(role, ["--model", spec.model, *spec.worker_flags_of(role)], environ)
    if spec.planner and parse_planner is not None:
        parse_planner(["--model", spec.model, *spec.planner_args], environ)
    for port, flag in [(spec.port, "--port"), *ports]:
        if port:
            check_port_free(spec.host, port, flag)


def check_checkpoint(model: str) -> None:
    """`model`'s config.json loads as the services will load it."""
    try:
        ModelConfig.from_dir(model)
    except (ValueError, FileNotFoundError, PermissionError):
        raise  # their messages name the file and what is wrong
    except (OSError, KeyError, TypeError) as exc:  # unreadable, or a config.json without what the loader needs
        raise ValueError(f"{model}: its config.json does not load ({type(exc).__name__}: {exc})") from exc


def check_port_free(host: str, port: int, flag: str) -> None:
    """Nothing listens on `port` of `host`: a server could bind it now (SO_REUSEADDR, as the servers set: a
    stopped one's connections may linger in TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            why = "is in use (another pdserve up, or another server?)" if taken else f"cannot be bound ({exc})"
            raise ValueError(f"port {port} on {host} {why}: choose another with {flag}") from exc
