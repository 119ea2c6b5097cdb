"""The gateway process: `pdserve gateway [flags]`, `python -m services.gateway [flags]` and the gateway image's
`pdserve-gateway` all run `main`. Settings come from PDSERVE_* variables and the flags; SIGTERM drains.

It imports what serving needs and nothing of the CLI or the workers, so the gateway starts without loading
torch (its image does not even carry it)."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from shared.config_fields import add_flags
from shared.settings import GatewaySettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's settings as flags (shared/settings.py declares them), and the log level."""
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_flags(parser, GatewaySettings)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM has drained the gateway; the process then exits without its teardown."""
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.draining import Drain, DrainingServer
    from shared.settings import from_args
    from shared.telemetry.lifecycle import EXIT_GRACE_S, exit_now, observe

    settings = from_args(GatewaySettings, args)
    listener = listen(settings.host, settings.port)  # before anything slow: a port in use is refused at once
    observe("gateway", settings.gateway_id, args.log_level, settings.trace_file)
    drain = Drain(settings.drain_timeout_s)  # SIGTERM: /ready 503, new requests 503, in-flight ones finish
    config = uvicorn.Config(
        create_app(settings, drain=drain),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=settings.drain_timeout_s,
    )
    DrainingServer(config, drain, exit_deadline_s=settings.drain_timeout_s + EXIT_GRACE_S).run(sockets=[listener])
    return exit_now(0)


def listen(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound here rather than by uvicorn after the app's start-up: a port that
    cannot be bound is a refused configuration (a ValueError: exit status 2, which a supervisor does not
    restart), said before the tokenizer loads, not uvicorn's exit 3 after it (which a supervisor would retry)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn's own bind
    try:
        return socket.create_server((host, port), family=family)  # SO_REUSEADDR, as uvicorn's
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ValueError(f"cannot listen on {host}:{port}: {why} (choose another port)") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-gateway", description="the OpenAI-compatible REST gateway")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, PermissionError) as exc:  # a bad setting, port or checkpoint: said
        from shared.telemetry.lifecycle import EXIT_REFUSED

        print(f"pdserve-gateway: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
