"""The planner process: `pdserve planner [flags]` (and `pdserve up --planner`). Settings come from PDSERVE_*
variables and the flags (shared/settings.py PlannerSettings); SIGTERM or Ctrl-C stops it, leaving every worker in
the role it has. It imports neither torch nor any worker code."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from litestar import Litestar, MediaType, Response, get

from shared.config_fields import add_flags
from shared.settings import PlannerSettings
from shared.telemetry import metrics

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_flags(parser, PlannerSettings)


def create_app(planner):
    """/plan (JSON), /metrics (Prometheus text), /ready and /health (200 while it serves: probes, deploy/k8s/)."""

    @get("/plan", media_type=MediaType.JSON)
    async def plan() -> dict:
        return planner.plan()

    @get("/metrics")
    async def prometheus() -> Response[bytes]:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @get("/ready", media_type=MediaType.TEXT)
    async def ready() -> str:
        return "ready"

    @get("/health", media_type=MediaType.TEXT)
    async def health() -> str:
        return "alive"

    return Litestar([plan, prometheus, ready, health])


async def serve(settings: PlannerSettings, actuator_factory=None) -> None:
    """Connect, decide every interval and serve the endpoint until SIGTERM / SIGINT. actuator_factory(nc,
    settings) makes the role switcher (None: the cluster's role control, services/planner/actuator.py)."""
    import uvicorn

    from services.planner.service import Planner, connect

    nc = await connect(settings)
    actuator = None
    if settings.switch_roles:
        if actuator_factory is None:
            from services.planner.actuator import RoleControl as actuator_factory  # noqa: N813
        actuator = actuator_factory(nc, settings)
    planner = Planner(settings, actuator)
    await planner.subscribe(nc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = uvicorn.Server(
        uvicorn.Config(create_app(planner), host=settings.host, port=settings.port, log_level="warning")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours stop both
    http = asyncio.create_task(server.serve(), name="planner-http")
    log.info(
        "planner for %s: every %.1f s, SLOs ttft %.0f ms tpot %.0f ms, %s, on http://%s:%d/plan",
        planner.model,
        settings.interval_s,
        settings.ttft_slo_ms,
        settings.tpot_slo_ms,
        "switching roles" if actuator else "publishing counts only",
        settings.host,
        settings.port,
    )
    try:
        await planner.run(stop)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await http
        with contextlib.suppress(Exception):
            await nc.drain()


def run(args: argparse.Namespace) -> int:
    from shared.settings import from_args
    from shared.telemetry.lifecycle import observe

    settings = from_args(PlannerSettings, args)
    observe("planner", "planner", args.log_level, settings.trace_file)
    asyncio.run(serve(settings))
    return 0
