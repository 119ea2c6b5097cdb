"""A request waiting in a worker's own queue when that worker switches role: the worker hands the queue back while
it switches, and a job routed there later (a gateway whose view lagged) has no taker, so the gateway's watchdog
moves it (NatsBackend._left_its_queue). Pure state: no NATS."""

from __future__ import annotations

from services.gateway.nats_backend import NatsBackend
from services.gateway.request_stream import Deadlines, RequestUpdates
from shared.messages import Heartbeat, QueuedEvent, Role, TakenEvent, TokensEvent
from shared.settings import GatewaySettings


def backend(*beats: Heartbeat) -> NatsBackend:
    gw = NatsBackend(GatewaySettings(model_name="demo", gateway_id="gw"))
    for beat in beats:
        gw.workers.record(beat, 0.0)
    return gw


def beat(worker_id: str, role: Role, **extra) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role=role, model="demo", rpc_address=None, **extra)


async def _noop(_: str) -> None:
    return None


def stream() -> RequestUpdates:
    return RequestUpdates("r", Deadlines(60, 60), _noop, lambda _: None)


def test_a_prefill_job_routed_to_a_worker_that_is_a_decode_worker_now_moves():
    routed = stream()
    routed.routed("w0")  # KV-aware routing: w0's own prefill queue
    assert backend(beat("w0", Role.PREFILL))._left_its_queue(routed) is None
    assert backend(beat("w0", Role.MIXED))._left_its_queue(routed) is None
    assert backend(beat("w0", Role.PREFILL, switching_to=Role.DECODE, draining=True))._left_its_queue(routed) is None
    why = backend(beat("w0", Role.DECODE))._left_its_queue(routed)
    assert why is not None and "w0 is a decode worker now" in why
    assert backend()._left_its_queue(routed) is None  # never heard of: its heartbeat's age judges it


def test_a_decode_job_routed_to_a_worker_that_is_a_prefill_worker_now_moves():
    queued = stream()
    queued.push(TakenEvent("r", 0, 0, "p"))
    queued.push(TokensEvent("r", 0, 0, [7], "p"))
    queued.push(QueuedEvent("r", 0, 1, "p", routed_to="d0"))  # decode-side reuse: d0's own decode queue
    assert queued.queued_for == "d0" and queued.queued_for_decode
    assert backend(beat("d0", Role.DECODE))._left_its_queue(queued) is None
    assert backend(beat("d0", Role.PREFILL))._left_its_queue(queued) is not None
    queued.push(TakenEvent("r", 0, 1, "d0"))  # taken: waits in no queue
    assert backend(beat("d0", Role.PREFILL))._left_its_queue(queued) is None
