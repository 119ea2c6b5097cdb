"""The admin API's HTTP side (services/gateway/admin.py) over a fake backend: who may call it (admin keys, not API
keys; off without any), what bad input gets (unknown role, unknown worker, a malformed body, the same role), how a
switch's outcome becomes a status, and what GET /admin/workers lists. The switch itself, over NATS with real
workers, is tests/integration/test_role_switch_host.py and tests/e2e/test_role_switch_e2e.py."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from services.gateway import create_app
from shared.messages import Heartbeat, Role, SwitchOutcome
from shared.role_control import SwitchResult, switch_refusal
from tests.unit.gateway.harness import FakeBackend, settings_for

ADMIN_KEY = "admin-key-for-the-tests"
API_KEY = "sk-api-key-not-admin"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def beat(worker_id: str, role: Role, **extra) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role=role, model="demo", rpc_address=None, **extra)


class AdminFake(FakeBackend):
    """Live workers from a list of heartbeats; a switch refused as the safety rule says, else done at once."""

    def __init__(self, tokenizer, beats: list[Heartbeat]) -> None:
        super().__init__(tokenizer)
        self.beats = beats
        self.switches: list[tuple[str, Role, float | None]] = []
        self.outcome: SwitchOutcome | None = None  # force an outcome (what the worker answered)

    def live_workers(self) -> list[tuple[Heartbeat, float]]:
        return [(b, 0.25) for b in self.beats]

    async def switch_role(self, worker_id: str, role: Role, finish_s: float | None) -> SwitchResult:
        self.switches.append((worker_id, role, finish_s))
        refusal = switch_refusal(self.beats, worker_id, role)
        if refusal is not None:
            return SwitchResult(worker_id, refusal[0], detail=refusal[1])
        if self.outcome is not None:
            return SwitchResult(worker_id, self.outcome, detail="as the worker said")
        was = next(b.role for b in self.beats if b.worker_id == worker_id)
        return SwitchResult(worker_id, SwitchOutcome.SWITCHED, role, was, took_s=1.5, handed_on=2)


@pytest.fixture
def admin_fake(tokenizer) -> AdminFake:
    beats = [beat("p0", Role.PREFILL), beat("p1", Role.PREFILL, running=2, free_blocks=30, total_blocks=40),
             beat("d0", Role.DECODE, parallel="tp=2 ep=1", rank_pids=(11, 12))]  # fmt: skip
    return AdminFake(tokenizer, beats)


@pytest.fixture
def admin(checkpoint, admin_fake):
    settings = settings_for(checkpoint, admin_keys=(ADMIN_KEY,), api_keys=(API_KEY,))
    with TestClient(create_app(settings, admin_fake)) as client:
        yield client


def test_without_the_admin_key_or_with_another_key_every_admin_call_is_refused(admin, admin_fake):
    for headers, why in (
        ({}, "missing admin key"),
        ({"Authorization": "Bearer nope"}, "invalid admin key"),
        ({"Authorization": f"Bearer {API_KEY}"}, "invalid admin key"),  # an API key is not an admin key
        ({"Authorization": ADMIN_KEY}, "missing admin key"),  # no Bearer scheme
    ):
        listed = admin.get("/admin/workers", headers=headers)
        switched = admin.post("/admin/workers/p0/role", json={"role": "decode"}, headers=headers)
        for resp in (listed, switched):
            assert resp.status_code == 401, (headers, resp.text)
            assert why in resp.json()["error"]["message"]
    assert admin_fake.switches == []  # nothing reached the backend


def test_with_no_admin_key_configured_the_admin_api_is_off(checkpoint, admin_fake):
    with TestClient(create_app(settings_for(checkpoint), admin_fake)) as client:
        resp = client.get("/admin/workers", headers=AUTH)
        assert resp.status_code == 403 and "admin API is disabled" in resp.json()["error"]["message"]
        assert client.post("/admin/workers/p0/role", json={"role": "decode"}).status_code == 403
    assert admin_fake.switches == []


def test_the_admin_routes_are_not_in_the_openai_document(admin):
    paths = admin.get("/schema/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/admin")]


def test_list_workers_gives_role_group_and_load(admin):
    resp = admin.get("/admin/workers", headers=AUTH)
    assert resp.status_code == 200
    body = resp.json()
    assert [w["id"] for w in body["data"]] == ["d0", "p0", "p1"]
    assert body["roles"] == {"prefill": 2, "decode": 1, "mixed": 0}
    d0, _, p1 = body["data"]
    assert d0["role"] == "decode" and d0["switching_to"] is None and not d0["draining"]
    assert d0["group"] == {"parallel": "tp=2 ep=1", "ranks": 2, "rank_pids": [11, 12]}
    assert p1["group"]["ranks"] == 1 and p1["load"]["running"] == 2 and p1["load"]["kv_usage"] == 0.25
    assert p1["last_heartbeat_s"] == 0.25


def test_a_switch_answers_with_its_result(admin, admin_fake):
    resp = admin.post("/admin/workers/p1/role", json={"role": "decode", "finish_s": 3}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"worker_id": "p1", "outcome": "switched", "role": "decode", "previous_role": "prefill",
                           "detail": "", "took_s": 1.5, "finished": 0, "handed_on": 2}  # fmt: skip
    assert admin_fake.switches == [("p1", Role.DECODE, 3)]


@pytest.mark.parametrize(
    ("worker", "body", "status", "says"),
    [
        ("p0", {"role": "verifier"}, 400, "unknown role 'verifier'"),
        ("p0", {"role": "decode", "finish_s": -1}, 400, "finish_s"),
        ("p0", {"role": "decode", "extra": 1}, 400, "invalid body"),
        ("p0", {"rôle": "decode"}, 400, "invalid body"),
        ("nobody", {"role": "decode"}, 404, "no live worker 'nobody'"),
        ("p0", {"role": "prefill"}, 409, "a prefill worker already"),
        ("d0", {"role": "prefill"}, 409, "the last live decode worker"),  # the deployment needs one
    ],
)
def test_bad_input_and_unsafe_switches_get_a_clear_4xx(admin, worker, body, status, says):
    resp = admin.post(f"/admin/workers/{worker}/role", json=body, headers=AUTH)
    assert resp.status_code == status, resp.text
    assert says in resp.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(admin):
    resp = admin.post("/admin/workers/p0/role", content=b"decode", headers=AUTH)
    assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        (SwitchOutcome.LOCKED, 409),
        (SwitchOutcome.TIMED_OUT, 409),
        (SwitchOutcome.REFUSED, 502),
        (SwitchOutcome.NO_REPLY, 504),
    ],  # fmt: skip
)
def test_what_the_worker_answered_becomes_the_status_with_the_result(admin, admin_fake, outcome, status):
    admin_fake.outcome = outcome
    resp = admin.post("/admin/workers/p0/role", json={"role": "decode"}, headers=AUTH)
    assert resp.status_code == status
    body = resp.json()
    assert body["error"]["code"] == status and body["switch"]["outcome"] == outcome.value
