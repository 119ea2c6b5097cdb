"""Live expert re-placement through the real stack: a prefill EP 2 group hands off to a decode EP 2 group, both
with --eplb set to plan at every step boundary (interval ~0, minimum gain 0), so each group re-places its experts
from its own phase's load while the requests stream. Every stream equals the single-process engine's greedy
output, and each role's /metrics counts its own rebalances and the bytes they moved."""

from __future__ import annotations

import time

import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.chaos import Load
from tests.e2e.test_group_handoff import HANDOFF_ENV, MAX_TOKENS, PROMPTS, _reference
from tests.e2e_support import scraped_total, start_stack

pytestmark = pytest.mark.slow  # two worker groups of two processes each (make test-slow)

EPLB_ENV = HANDOFF_ENV | {
    "PDSERVE_EPLB": "1",
    "PDSERVE_EPLB_WINDOW_STEPS": "4",
    "PDSERVE_EPLB_INTERVAL_S": "0.001",
    "PDSERVE_EPLB_MIN_GAIN": "0",
    "PDSERVE_EPLB_REDUNDANT": "2",
}


def test_prefill_ep2_to_decode_ep2_with_live_rebalancing_is_token_exact(model_dir) -> None:
    reference = _reference(model_dir)
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=1, threads_per_worker=2,
                     parallel={"prefill": (1, 2), "decode": (1, 2)}, env=EPLB_ENV)  # fmt: skip
    stack = start_stack(spec)
    try:
        outcomes = Load(stack.url, PROMPTS, MAX_TOKENS).results()
        for o in outcomes:
            assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
            assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"
        # the workers record what their rebalancer did once per heartbeat: wait for the next records
        deadline = time.monotonic() + 20
        rebalances: dict[str, float] = {}
        while time.monotonic() < deadline:
            rebalances = {
                role: sum(scraped_total(u, "pdserve:eplb_rebalances_total", role=role) for u in stack.metrics_urls())
                for role in ("prefill", "decode")
            }
            if all(rebalances.values()):
                break
            time.sleep(1)
        assert all(rebalances.values()), rebalances  # each role re-placed its experts from its own load
        for role in ("prefill", "decode"):
            moved = sum(scraped_total(u, "pdserve:eplb_bytes_moved_total", role=role) for u in stack.metrics_urls())
            assert moved > 0 and moved % (3 * 32 * 64 * 4) == 0, (role, moved)  # whole slots of the tiny model
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
