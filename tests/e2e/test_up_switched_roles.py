"""`pdserve up` keeps a switched worker's role (services/local/worker_roles.py): the real command with two prefill
workers and one decode worker, prefill-0 switched to decode through the gateway's admin API, then

  - SIGKILL to it: the supervisor restarts it as a decode worker, with the same worker id and flags;
  - SIGHUP (a rolling restart): its replacement decodes too, and the roles are counted as they are (prefill-1, now
    the only prefill worker, is replaced after its replacement beats; the stack serves throughout).

Without the supervisor reading roles, both would bring prefill-0 back as a prefill worker, undoing the switch."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_up_supervisor import DRAIN_S, Up, assert_all_gone, wait_until

pytestmark = pytest.mark.slow  # three workers, one restart and a rolling restart of three: minutes on 2 cores

ADMIN_KEY = "admin-key-of-the-switched-roles-test"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def up_2p1d(tmp_path, model_dir):
    up = Up(tmp_path, model_dir, "--prefill", "2", "--decode", "1", env={"PDSERVE_ADMIN_KEYS": ADMIN_KEY})
    yield up
    up.kill_all()


def roles(up: Up) -> dict[str, str]:
    """The live workers by id → role, as the gateway's admin API lists them (an empty dict while it does not answer)."""
    try:
        resp = httpx.get(f"{up.url}/admin/workers", headers=AUTH, timeout=10)
    except httpx.TransportError:
        return {}
    return {w["id"]: w["role"] for w in resp.json()["data"]} if resp.status_code == 200 else {}


def worker_pid(up: Up, worker_id: str) -> int | None:
    """The pid of the `pdserve <role> --worker-id worker_id` process below `pdserve up`; None if there is none."""
    for pid in up.children():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--worker-id" in args and args[args.index("--worker-id") + 1] == worker_id:
            return pid
    return None


def command_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def completes(up: Up) -> bool:
    body = {"model": "demo", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{up.url}/v1/completions", json=body, timeout=60)
    return resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_a_switched_worker_stays_switched_through_a_restart_and_a_rolling_restart(up_2p1d):
    up = up_2p1d
    up.wait_ready()
    p0 = f"prefill-0-{up.pid}"
    launch = {p0: "prefill", f"prefill-1-{up.pid}": "prefill", f"decode-2-{up.pid}": "decode"}
    wait_until(lambda: roles(up) == launch, 30, f"the admin API lists {launch}")
    resp = httpx.post(f"{up.url}/admin/workers/{p0}/role", json={"role": "decode"}, headers=AUTH, timeout=120)
    assert resp.status_code == 200 and resp.json()["role"] == "decode", resp.text
    wait_until(lambda: "prefill-0 serves as decode now (it was prefill)" in up.output(), 10, "the supervisor reads it")

    # 1. it dies: restarted as a decode worker, the same id and flags
    old = worker_pid(up, p0)
    assert old is not None
    launched = command_of(old)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: "prefill-0 exited (killed by SIGKILL)" in up.output(), 10, "the supervisor sees it die")
    assert "restarting it in 0.5 s as decode" in up.output()
    wait_until(lambda: worker_pid(up, p0) not in (None, old), 10, "the supervisor restarts it")
    new = worker_pid(up, p0)
    assert new is not None
    again = command_of(new)
    assert launched[3] == "prefill" and again[3] == "decode", (launched, again)  # python -m services.cli <role>
    assert again[4:] == launched[4:]  # its worker id, ports and flags
    wait_until(lambda: roles(up).get(p0) == "decode", 120, "it serves as decode again")
    assert completes(up)

    # 2. a rolling restart: prefill-0 replaced as decode; prefill-1, the only prefill worker now, surges
    os.kill(up.pid, signal.SIGHUP)
    wait_until(lambda: "rolling restart done" in up.output() or "rolling restart stopped" in up.output(), 400,
               "the rolling restart ends")  # fmt: skip
    out = up.output()
    assert "rolling restart done: 3 workers replaced" in out, out[-3000:]
    assert "prefill-0 (pid" in out and "drains while the other decode workers serve" in out, out[-3000:]
    assert "prefill): its replacement" in out, out[-3000:]
    wanted = {f"{p0}-1": "decode", f"prefill-1-{up.pid}-1": "prefill", f"decode-2-{up.pid}-1": "decode"}
    wait_until(lambda: roles(up) == wanted, 30, f"the replacements serve in their roles: {wanted}")
    assert completes(up)
    os.kill(up.pid, signal.SIGTERM)
    assert up.exit_status(DRAIN_S + 15) == 0
    assert_all_gone(up, 2.0)
