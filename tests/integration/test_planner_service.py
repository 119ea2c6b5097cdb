"""The SLO planner's process against a real nats-server: it folds the workers' heartbeats and the gateways' request
statistics it hears, decides on them, asks its actuator for the switch, and serves /plan and /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import nats
import pytest

from services.local.infra import free_port, start_nats
from services.planner.main import serve
from shared.messages import (
    Heartbeat,
    PathCalibration,
    RequestArrived,
    RequestEnded,
    Role,
    encode,
    heartbeat_subject,
    request_stats_subject,
)
from shared.settings import PlannerSettings

MODEL = "demo"


@pytest.fixture
def nats_server():
    server = start_nats()
    yield server
    server.stop()


class RecordingActuator:
    def __init__(self, nc, settings) -> None:
        self.calls: list[tuple[str, Role]] = []

    async def switch(self, worker_id: str, role: Role) -> None:
        self.calls.append((worker_id, role))


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def test_planner_hears_the_cluster_switches_a_worker_and_serves_its_plan(nats_server):
    port = free_port()
    settings = PlannerSettings(
        model=MODEL,
        nats_url=nats_server.url,
        port=port,
        interval_s=0.5,
        confirm_intervals=2,
        cooldown_s=0.0,
        cluster_secret="s" * 32,
    )
    actuators: list[RecordingActuator] = []

    def factory(nc, s):
        actuators.append(RecordingActuator(nc, s))
        return actuators[-1]

    async def scenario() -> tuple[dict, bytes]:
        planner = asyncio.create_task(serve(settings, actuator_factory=factory))
        nc = await nats.connect(nats_server.url)
        slow_prefill = PathCalibration(prefill_tokens_per_s=4000.0, prefill_step_ms=10.0)
        decode = PathCalibration(decode_step_ms=20.0)
        try:
            for _ in range(
                30
            ):  # a prefill-heavy load: ~9 req/s of 800-token prompts, 8-token answers (one prefill worker
                # is over-full at 4000 tokens/s, three are not)
                await nc.publish(
                    heartbeat_subject("prefill", "p0"),
                    encode(
                        Heartbeat("p0", Role.PREFILL, MODEL, "127.0.0.1:1", running=1, path_calibration=slow_prefill)
                    ),
                )
                for i in range(3):
                    await nc.publish(
                        heartbeat_subject("decode", f"d{i}"),
                        encode(Heartbeat(f"d{i}", Role.DECODE, MODEL, None, running=i, path_calibration=decode)),
                    )
                await nc.publish(heartbeat_subject("decode", "other"), encode(
                    Heartbeat("other", Role.DECODE, "another-model", None)))  # fmt: skip
                for _ in range(1):
                    rid = f"r{_}-{asyncio.get_running_loop().time()}"
                    now = time.time()
                    await nc.publish(
                        request_stats_subject(MODEL),
                        encode(
                            RequestArrived(gateway_id="gw", request_id=rid, prompt_tokens=800, at=now, max_tokens=8)
                        ),
                    )
                    await nc.publish(request_stats_subject(MODEL), encode(RequestEnded(
                        gateway_id="gw", request_id=rid, prompt_tokens=800, at=now, output_tokens=8,
                        ttft_s=3.0, tpot_s=0.02, finish_reason="length")))  # fmt: skip
                await nc.publish(request_stats_subject(MODEL), b"{not json")  # dropped, not fatal
                await nc.flush()
                await asyncio.sleep(0.1)
                if actuators and actuators[0].calls:
                    break
            status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/plan")
            assert status == 200
            _, metrics = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
            return json.loads(body), metrics
        finally:
            await nc.close()
            planner.cancel()

    plan, metrics = asyncio.run(scenario())
    assert actuators and actuators[0].calls == [("d0", Role.PREFILL)]  # the least loaded decode worker
    latest = plan["latest"]
    assert latest["current"] == {"prefill": 1, "decode": 3}  # the other model's worker is not counted
    assert latest["forecast"]["prompt_p90"] == 800 and latest["forecast"]["rate"] > 1
    assert latest["costs"]["prefill_tokens_per_s"] == 4000.0
    switched = [h for h in plan["history"] if h["action"] == "switch"]
    assert switched and switched[0]["switch"]["worker"] == "d0"
    assert 'pdserve:planner_desired_workers{model_name="demo",role="prefill"}' in metrics.decode()
