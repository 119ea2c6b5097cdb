"""A worker's /health and /ready (shared/worker/probes.py) from its state, served beside /metrics over real HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from shared.telemetry.metrics import serve_metrics
from shared.worker.probes import WorkerProbes


@dataclass
class State:
    serving: bool = False
    draining: bool = False
    failure: BaseException | None = None
    last_beat: float | None = None
    connected: bool = True

    def nats_connected(self) -> bool:
        return self.connected


def test_readiness_follows_the_life_of_a_worker():
    state = State()
    probes = WorkerProbes(state)
    assert probes.ready() == (False, "starting")
    state.serving = True
    assert probes.ready() == (True, "taking jobs")
    state.connected = False
    assert probes.ready() == (False, "NATS connection lost; reconnecting")
    state.connected, state.draining = True, True
    assert probes.ready() == (False, "draining: taking no new jobs")


def test_health_is_a_turning_event_loop_and_a_live_engine():
    state = State()
    probes = WorkerProbes(state, stale_s=10.0)
    assert probes.health() == (True, "alive")  # loading, before the first beat
    state.last_beat = time.monotonic() - 5.0
    assert probes.health()[0]
    state.connected = False  # NATS away: heartbeats are still built, nothing to restart
    assert probes.health()[0]
    state.last_beat = time.monotonic() - 11.0
    ok, why = probes.health()
    assert not ok and "no heartbeat for 11 s" in why
    state.last_beat, state.failure = time.monotonic(), RuntimeError("boom")
    assert probes.health() == (False, "the engine failed: RuntimeError('boom')")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_metrics_server_answers_the_probes():
    state = State(serving=True)
    port = serve_metrics("127.0.0.1", 0, WorkerProbes(state).routes())
    base = f"http://127.0.0.1:{port}"
    status, body = _get(f"{base}/ready")
    assert status == 200 and json.loads(body) == {"status": "ok", "detail": "taking jobs"}
    state.draining = True
    status, body = _get(f"{base}/ready")
    assert status == 503 and json.loads(body) == {"status": "unavailable", "detail": "draining: taking no new jobs"}
    assert _get(f"{base}/health")[0] == 200
    status, body = _get(f"{base}/metrics")
    assert status == 200 and b"pdserve:" in body
    assert _get(f"{base}/nothing")[0] == 404
    assert _get(f"http://127.0.0.1:{serve_metrics('127.0.0.1', 0)}/ready")[0] == 404  # no probes given
