"""Overload and shutdown: admission arithmetic (queue depth, KV capacity, Retry-After), the 429 and draining
answers over HTTP, and with real processes a flood (some 429s, every admitted request complete) and a gateway
SIGTERM'd while streams are open (each stream completes, the gateway exits 0). Plus the soak, briefly."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from litestar.testing import TestClient
from prometheus_client import REGISTRY

from services.gateway import create_app
from services.gateway.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S, Admission, Load, admit
from services.gateway.backend import GenerationJob, Overloaded
from services.gateway.draining import Drain
from services.gateway.liveness import WorkerTable
from shared.messages import Heartbeat, Sampling
from shared.model.demo import write_demo_checkpoint
from shared.settings import GatewaySettings

# ---- admission arithmetic ---------------------------------------------------------------------------


@dataclass
class Req:
    prompt_tokens: int
    delivered: int = 0
    first_token_seen: bool = False


def running(prompt: int, delivered: int) -> Req:
    return Req(prompt, delivered, first_token_seen=True)


def test_load_counts_pending_and_kv():
    load = Load.of([Req(10), running(20, 5), running(7, 0)])
    assert (load.requests, load.pending, load.kv_tokens) == (3, 1, 10 + 25 + 7)


def test_queue_bound():
    adm = Admission(max_pending_requests=2, kv_overcommit=1.0)
    adm.check("new", 5, {"a": Req(5), "b": running(5, 3), "c": running(5, 9)}, None, now=0.0)  # 1 pending: in
    with pytest.raises(Overloaded) as exc:
        adm.check("new2", 5, {"a": Req(5), "b": Req(5), "c": running(5, 3)}, None, now=0.0)
    assert exc.value.reason == "queue" and "2 requests are waiting for their first token (limit 2)" in str(exc.value)
    assert exc.value.retry_after_s == RETRY_AFTER_UNKNOWN_S  # nothing has left yet: no rate to go by


def test_kv_bound_with_overcommit():
    in_flight = {"a": running(40, 30)}  # holds 70 tokens
    Admission(100, kv_overcommit=1.0).check("b", 30, in_flight, kv_capacity=100, now=0.0)  # 100: exactly full
    with pytest.raises(Overloaded) as exc:
        Admission(100, kv_overcommit=1.0).check("b", 31, in_flight, kv_capacity=100, now=0.0)
    assert exc.value.reason == "kv" and "over the limit of 100" in exc.value.message
    Admission(100, kv_overcommit=1.5).check("b", 80, in_flight, kv_capacity=100, now=0.0)  # 150 allowed
    with pytest.raises(Overloaded):
        Admission(100, kv_overcommit=0.5).check("b", 1, in_flight, kv_capacity=100, now=0.0)


def test_kv_bound_skipped_when_unknown_or_alone():
    adm = Admission(100, kv_overcommit=1.0)
    adm.check("a", 10_000, {}, kv_capacity=100, now=0.0)  # alone: waiting would not make room for it
    adm.check("b", 10_000, {"x": running(5_000, 0)}, kv_capacity=None, now=0.0)  # no worker reports capacity


def test_retry_after_follows_the_departure_rate():
    adm = Admission(max_pending_requests=1, kv_overcommit=1.0, window_s=30.0)
    for i in range(10):  # admitted at t=0, one after the other (each sees the earlier ones in flight)
        adm.check(f"r{i}", 1, {f"r{j}": running(1, 1) for j in range(i)}, None, now=0.0)
    # at t=10 five of them have left: 0.5 requests/s; 3 must leave (3 pending, limit 1) → 6 s
    pending = {f"r{i}": Req(1) for i in range(5, 8)} | {"r8": running(1, 1), "r9": running(1, 1)}
    with pytest.raises(Overloaded) as exc:
        adm.check("late", 1, pending, None, now=10.0)
    assert exc.value.retry_after_s == 6
    assert adm.retry_after_s(1, now=10.0) == 2 and adm.retry_after_s(1000, now=10.0) == RETRY_AFTER_MAX_S
    assert adm.retry_after_s(1, now=45.0) == RETRY_AFTER_UNKNOWN_S  # those departures fell out of the window


def test_kv_retry_after_counts_the_requests_that_must_leave():
    adm = Admission(max_pending_requests=10, kv_overcommit=1.0, window_s=30.0)
    adm.check("a", 1, {}, None, now=0.0)
    adm.check("b", 1, {"a": running(1, 0)}, None, now=0.0)
    adm._note_departures([], now=2.0)  # both left within 2 s: 1 request/s
    in_flight = {f"r{i}": running(10, 0) for i in range(4)}  # 40 tokens, 10 per request
    with pytest.raises(Overloaded) as exc:
        adm.check("big", 25, in_flight, kv_capacity=40, now=2.0)  # 25 over: 3 requests of 10 must leave
    assert exc.value.retry_after_s == 3


def test_admission_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        Admission(0, 1.0)
    with pytest.raises(ValueError):
        Admission(1, 0.0)


# ---- live capacity ----------------------------------------------------------------------------------


def beat(worker: str, role: str, blocks: int = 0, block_size: int = 16, draining: bool = False) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        role=role,
        model="demo",
        rpc_address=None,
        total_blocks=blocks,
        free_blocks=blocks,
        block_size=block_size,
        draining=draining,
    )


def test_kv_capacity_is_decode_kv_of_live_workers_not_draining():
    table = WorkerTable(ttl_s=5.0)
    table.record(beat("p", "prefill", blocks=1000), now=0.0)  # prefill KV is short-lived: not counted
    table.record(beat("d1", "decode", blocks=10), now=0.0)
    table.record(beat("d2", "decode", blocks=5, block_size=32), now=0.0)
    table.record(beat("m", "mixed", blocks=2), now=0.0)
    table.record(beat("d3", "decode", blocks=100, draining=True), now=0.0)
    assert table.kv_capacity("demo", 1.0) == 10 * 16 + 5 * 32 + 2 * 16
    assert table.kv_capacity("other", 1.0) is None
    table.record(beat("d1", "decode", blocks=10), now=4.0)
    assert table.kv_capacity("demo", 6.0) == 160  # the others went quiet
    old = WorkerTable()
    old.record(beat("d", "decode", blocks=10, block_size=0), now=0.0)  # a worker that does not report it
    assert old.kv_capacity("demo", 0.0) is None


def test_draining_workers_do_not_serve():
    table = WorkerTable()
    table.record(beat("p", "prefill"), now=0.0)
    table.record(beat("d", "decode", draining=True), now=0.0)
    ok, reason = table.can_serve("demo", 0.0)
    assert not ok and "no live decode worker" in reason
    table.record(beat("p", "prefill", draining=True), now=0.0)
    assert table.can_serve("demo", 0.0) == (False, "every live worker for model 'demo' is draining (2 shutting down)")
    table.record(beat("d2", "decode"), now=0.0)
    table.record(beat("p2", "prefill"), now=0.0)
    assert table.can_serve("demo", 0.0) == (True, "live workers for demo: 1 prefill, 1 decode")


def _rejected(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "pdserve:requests_rejected_total", {"model_name": "demo", "role": "gateway", "reason": reason}
    )
    return value or 0.0


def test_admit_hook_counts_rejections():
    settings = GatewaySettings(max_pending_requests=1)
    table = WorkerTable()
    table.record(beat("m", "mixed", blocks=4), now=time.monotonic())  # 64 tokens
    job = GenerationJob("r1", "demo", [1] * 10, Sampling(max_tokens=5))
    admit(settings, table, {}, job)
    before = _rejected("queue"), _rejected("kv")
    with pytest.raises(Overloaded):
        admit(settings, table, {"r1": Req(10)}, GenerationJob("r2", "demo", [1], Sampling(max_tokens=5)))
    with pytest.raises(Overloaded):
        admit(settings, table, {"r1": running(50, 10)}, GenerationJob("r3", "demo", [1] * 5, Sampling(max_tokens=5)))
    assert (_rejected("queue"), _rejected("kv")) == (before[0] + 1, before[1] + 1)


# ---- the HTTP answers (in-process app, fake backends) -------------------------------------------------


class OverloadedBackend:
    def __init__(self) -> None:
        self.ready = (True, "fine")

    async def open(self, job: GenerationJob):
        raise Overloaded("the server is at capacity: try later", 7, reason="queue")

    async def cancel(self, request_id: str) -> None:
        pass

    async def readiness(self) -> tuple[bool, str]:
        return self.ready

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("model") / "demo", arch="qwen3_moe", size="tiny")


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_429_with_retry_after(model_dir, stream):
    app = create_app(GatewaySettings(model=str(model_dir), model_name="demo"), OverloadedBackend())
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "error": {
            "message": "the server is at capacity: try later",
            "type": "rate_limit_error",
            "param": None,
            "code": 429,
        }
    }


def test_draining_gateway_refuses_new_work_and_is_not_ready(model_dir):
    drain = Drain(timeout_s=30)
    app = create_app(GatewaySettings(model=str(model_dir), model_name="demo"), OverloadedBackend(), drain=drain)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        drain.begin(time.monotonic())
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("draining")
        before = _rejected("draining")
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert _rejected("draining") == before + 1
        assert client.get("/health").status_code == 200


def test_drain_timeline():
    drain = Drain(timeout_s=20)
    assert not drain.draining and drain.left_s(100.0) == 20
    assert drain.begin(100.0) and not drain.begin(101.0)  # a second signal does not restart the clock
    assert drain.reserve_s == 5.0
    assert not drain.expired(114.9) and drain.expired(115.0)
    assert drain.left_s(112.0) == 8.0 and drain.left_s(130.0) == 0.0
    with pytest.raises(ValueError):
        Drain(0)
