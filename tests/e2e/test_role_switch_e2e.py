"""Role switching on a real stack (2 prefill + 1 decode worker, gateway with an admin key), under streaming load:
a prefill worker switched to decode while streams run, new streams decoded on it, then switched back to prefill
with finish_s 0 while it decodes some of them (they are handed on to the prefill queue with their tokens so far).
Every stream completes token for token as the single-process engine writes it, each position once; afterwards no
KV is held, no block used and no `pd:*` key left on any worker. The admin API refuses calls without the admin key
or with another key, bad input, and the switch of the last decode worker."""

from __future__ import annotations

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.chaos import EventWatch, Load, settled
from tests.e2e import test_faults
from tests.e2e.test_faults import FAST, MAX_TOKENS, SHORT, check, prompts
from tests.e2e_support import scraped_total, start_stack

pytestmark = pytest.mark.slow  # a 3-worker stack, two switches under load (~1-2 min on 2 cores)

reference = test_faults.reference  # the single-process engine's greedy outputs (a module fixture)
ADMIN_KEY = "admin-key-of-the-role-switch-test"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def stack_2p1d(model_dir):
    # decode-side reuse off: the repeated prompts would be routed to the decode worker whose cache holds them, and
    # the switched worker might decode none (the shared decode queue feeds both)
    env = FAST | {"PDSERVE_ADMIN_KEYS": ADMIN_KEY, "PDSERVE_DECODE_KV_REUSE": "false"}
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=2, decode=1, threads_per_worker=1, env=env)
    stack = start_stack(spec)
    yield stack
    stack.stop()


def workers(stack) -> dict[str, dict]:
    """The admin API's worker list, by the stack's service name (prefill-0, prefill-1, decode-2)."""
    resp = httpx.get(f"{stack.url}/admin/workers", headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return {w["id"].rsplit("-", 1)[0]: w for w in resp.json()["data"]}


def switch(stack, worker_id: str, role: str, **extra) -> httpx.Response:
    return httpx.post(f"{stack.url}/admin/workers/{worker_id}/role", json={"role": role, **extra}, headers=AUTH,
                      timeout=120)  # fmt: skip


def test_the_admin_api_refuses_without_the_key_and_bad_input(stack_2p1d):
    stack = stack_2p1d
    listed = workers(stack)
    assert {name: w["role"] for name, w in listed.items()} == {"prefill-0": "prefill", "prefill-1": "prefill",
                                                               "decode-2": "decode"}  # fmt: skip
    p0, d2 = listed["prefill-0"]["id"], listed["decode-2"]["id"]
    url = f"{stack.url}/admin/workers/{p0}/role"
    assert httpx.get(f"{stack.url}/admin/workers", timeout=10).status_code == 401
    assert httpx.post(url, json={"role": "decode"}, timeout=10).status_code == 401
    assert (
        httpx.post(url, json={"role": "decode"}, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code
        == 401
    )
    assert switch(stack, p0, "verifier").status_code == 400
    assert switch(stack, "no-such-worker", "decode").status_code == 404
    same = switch(stack, p0, "prefill")
    assert same.status_code == 409 and same.json()["switch"]["outcome"] == "same_role"
    last = switch(stack, d2, "prefill")  # the only decode worker: the deployment needs one
    assert last.status_code == 409 and last.json()["switch"]["outcome"] == "unsafe", last.text
    assert {name: w["role"] for name, w in workers(stack).items()}["decode-2"] == "decode"


def test_a_prefill_worker_switches_to_decode_and_back_under_streaming_load(stack_2p1d, reference):
    stack = stack_2p1d
    p0 = workers(stack)["prefill-0"]["id"]
    p0_metrics = f"http://127.0.0.1:{stack.metrics_ports['prefill-0']}/metrics"
    watch = EventWatch(stack.nats_url)
    try:
        # 1. prefill → decode while streams run (their prefills on both prefill workers, their decode on decode-2)
        first = Load(stack.url, prompts(SHORT), MAX_TOKENS)
        first.progress.wait(lambda p: min(p.counts) >= 3)
        to_decode = switch(stack, p0, "decode")
        assert to_decode.status_code == 200, to_decode.text
        assert to_decode.json()["role"] == "decode" and to_decode.json()["previous_role"] == "prefill"
        listed = workers(stack)["prefill-0"]
        assert listed["role"] == "decode" and listed["switching_to"] is None
        assert scraped_total(p0_metrics, "pdserve:worker_role", role="decode") == 1
        assert scraped_total(p0_metrics, "pdserve:worker_role", role="prefill") == 0
        ready = httpx.get(p0_metrics.replace("/metrics", "/ready"), timeout=10)
        assert ready.status_code == 200, ready.text  # the probes follow the role serving now

        # 2. new streams: decoded on decode-2 and on the switched worker; back to prefill while it decodes some
        second = Load(stack.url, prompts(SHORT), MAX_TOKENS)
        watch.wait_for(lambda w: any(worker == p0 for worker in w.holders().values()), timeout_s=60)
        second.progress.wait(lambda p: min(p.counts) >= 2)
        held_by_p0 = [rid for rid, worker in watch.holders().items() if worker == p0]
        to_prefill = switch(stack, p0, "prefill", finish_s=0)
        assert to_prefill.status_code == 200, to_prefill.text
        body = to_prefill.json()
        assert body["role"] == "prefill" and body["handed_on"] >= 1, (body, held_by_p0)
        outcomes = first.results() + second.results()
    finally:
        watch.close()
    check(outcomes, reference, "a prefill worker switched to decode and back under load", moved=0)
    assert scraped_total(p0_metrics, "pdserve:role_switches_total", outcome="switched") == 2
    assert scraped_total(p0_metrics, "pdserve:role_switch_handed_on_total") == body["handed_on"]
    assert {name: w["role"] for name, w in workers(stack).items()} == {"prefill-0": "prefill", "prefill-1": "prefill",
                                                                      "decode-2": "decode"}  # fmt: skip
    settled(stack)  # no KV held or block used on any worker, no pd:* key (the lock's included)
