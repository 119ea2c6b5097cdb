"""The role `pdserve up`'s supervisor reads of a worker (services/local/worker_roles.py): from the gauge the worker
itself sets (shared/worker/gauges.py record_role), in the text its /metrics serves."""

from __future__ import annotations

from services.local.worker_roles import role_served
from shared.telemetry import metrics
from shared.worker import gauges

ROLES = ("prefill", "decode", "mixed")


def _own(model: str) -> str:
    """This process's /metrics text, but for other models' series: the registry is the process's, and the suite's
    other tests record roles of models of their own (a worker serves one)."""
    body, _ = metrics.exposition()
    return "".join(line + "\n" for line in body.decode().splitlines() if f'model_name="{model}"' in line)


def test_the_role_a_worker_records_is_the_role_read():
    gauges.record_role("role-read-model", "prefill", ROLES)
    assert role_served(_own("role-read-model")) == "prefill"
    gauges.record_role("role-read-model", "decode", ROLES)  # a switch: the gauge flips
    assert role_served(_own("role-read-model")) == "decode"


def test_no_role_when_none_serves_or_the_text_is_not_a_workers():
    assert role_served("") is None
    assert role_served('pdserve:num_requests_running{model_name="m",role="prefill"} 1.0\n') is None
    idle = "".join(f'pdserve:worker_role{{model_name="m",role="{r}"}} 0.0\n' for r in ROLES)
    assert role_served(idle) is None
    two = idle.replace('role="prefill"} 0.0', 'role="prefill"} 1.0').replace('role="decode"} 0.0', 'role="decode"} 1.0')
    assert role_served(two) is None  # two roles at 1 (not a worker's text): no single answer
