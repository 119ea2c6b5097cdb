#!/usr/bin/env python3
"""Container healthcheck for every pdserve role (installed in the image as `pdserve-healthcheck`).

    pdserve-healthcheck gateway                 GET /health on this container's gateway port
    pdserve-healthcheck prefill|decode|mixed    a heartbeat from *this* container's worker on NATS

A worker is healthy once its engine is loaded and it publishes heartbeats (pd.hb.<role>.<worker>): the
check listens on NATS for one whose worker id is PDSERVE_WORKER_ID, or, by default, contains this container's
hostname (worker ids default to `worker-<hostname>-<random>`), whatever role it serves now (a worker may switch
role: the container's name is the role it started with). It connects as the services do
(shared.bus.connect with the PDSERVE_* settings: URL, credentials, TLS), so a check that passes also proves
the credentials. Exit 0 = healthy; otherwise the reason is on stderr.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import urllib.request

TIMEOUT_S = 5.0
CLIENT_NAME = "healthcheck"


def check_gateway() -> bool:
    port = os.environ.get("PDSERVE_PORT", "8000")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT_S) as resp:
        return resp.status == 200


def _is_mine(worker_id: str) -> bool:
    wanted = os.environ.get("PDSERVE_WORKER_ID")
    return worker_id == wanted if wanted else socket.gethostname() in worker_id


async def check_worker(role: str) -> bool:
    from shared import bus

    try:
        return await asyncio.wait_for(_heartbeat_seen(role), TIMEOUT_S)
    except TimeoutError:
        problem = bus.connection_problem(CLIENT_NAME)
        why = f"cannot connect to NATS: {problem}" if problem else f"no heartbeat from this {role} worker"
        print(f"{why} (within {TIMEOUT_S:.0f}s)", file=sys.stderr)
        return False


async def _heartbeat_seen(role: str) -> bool:
    from shared import bus
    from shared.messages import HEARTBEAT_WILDCARD, Heartbeat, decode
    from shared.settings import CommonSettings, from_env

    nc = await bus.connect(from_env(CommonSettings), CLIENT_NAME)
    seen = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except Exception:
            return
        # this container's worker, whatever role it serves now: it may have switched (docs/architecture.md)
        if _is_mine(beat.worker_id) and not seen.done():
            seen.set_result(True)

    try:
        await nc.subscribe(HEARTBEAT_WILDCARD, cb=on_beat)
        return await seen
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("gateway", "prefill", "decode", "mixed"):
        print("usage: pdserve-healthcheck gateway|prefill|decode|mixed", file=sys.stderr)
        return 2
    try:
        ok = check_gateway() if argv[0] == "gateway" else asyncio.run(check_worker(argv[0]))
    except Exception as exc:  # connection refused, HTTP error, NATS down: unhealthy, with the reason
        print(f"unhealthy: {exc!r}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
