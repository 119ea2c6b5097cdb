"""Live expert re-placement through the real stack: prefill and decode groups of the same and of different parallel
degrees, both with --eplb planning at every step boundary (interval ~0, minimum gain 0, 4 redundant slots: 12 slots
split over 2 or 4 ranks), so each group re-places its experts from its own phase's load while the requests stream:

- prefill EP 2 → decode EP 2: both groups' pools hold every KV head, so the hand-off is a single worker's (the
  decode leader pulls the whole KV and its op stream broadcasts it to its follower);
- prefill TP 2 + EP 2 → decode EP 4: each prefill rank serves its own KV heads (the group record), the decode
  leader pulls the heads rank by rank and assembles them for its 3 followers (docs: "KV hand-off between TP
  layouts");
- prefill EP 4 → decode TP 2 + EP 2: a single-worker-like source, each decode rank pulling its own heads.

Every stream equals the single-process engine's greedy output, the decode side never recomputes a prompt (its
prefill_tokens stays 0: the KV was pulled), each heartbeat names its group's degrees, and each role's /metrics counts
its own rebalances and the whole slots they moved."""

from __future__ import annotations

import time

import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.chaos import Load, settled
from tests.e2e.test_group_handoff import HANDOFF_ENV, MAX_TOKENS, PROMPTS, _reference
from tests.e2e_support import heartbeats, scraped_total, start_stack

pytestmark = pytest.mark.slow  # two worker groups, six rank processes on two cores (make test-slow)

SLOT_BYTES = 3 * 32 * 64 * 4  # one expert of the tiny model: gate_up (2I, D) + down (D, I), float32
EPLB_ENV = HANDOFF_ENV | {
    "PDSERVE_EPLB": "1",
    "PDSERVE_EPLB_WINDOW_STEPS": "4",
    "PDSERVE_EPLB_INTERVAL_S": "0.001",
    "PDSERVE_EPLB_MIN_GAIN": "0",
    "PDSERVE_EPLB_REDUNDANT": "4",  # (8 + 4) slots split over 2 and over 4 ranks
    # a move's layers all staged at one boundary: a prefill group steps only a few times for these prompts (fewer
    # when a loaded host lets more of them queue into one step), and a move staged a layer per step could outlast
    # its steps and never swap in; one layer per boundary is tested in tests/integration/test_eplb_group.py
    "PDSERVE_EPLB_STAGE_LAYERS": "0",
}


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((1, 2), (1, 2)), ((2, 2), (1, 4)), ((1, 4), (2, 2))],
    ids=["ep2-to-ep2", "tp2ep2-to-ep4", "ep4-to-tp2ep2"],
)
def test_groups_hand_off_token_exact_with_live_rebalancing(
    model_dir, prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    reference = _reference(model_dir)
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=1, threads_per_worker=2,
                     parallel={"prefill": prefill, "decode": decode}, env=EPLB_ENV)  # fmt: skip
    stack = start_stack(spec)
    try:
        outcomes = Load(stack.url, PROMPTS, MAX_TOKENS).results()
        for o in outcomes:
            assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
            assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"
        settled(stack)  # every block free, no KV held, no pd:* key, every worker idle
        assert stack.nats_url is not None
        by_role = {b.role.value: b for b in heartbeats(stack.nats_url).values()}
        assert by_role["decode"].prefill_tokens == 0, "the decode side ran a prompt's forward pass (recomputed)"
        for role, (tp, ep) in (("prefill", prefill), ("decode", decode)):
            assert by_role[role].parallel == f"tp={tp} ep={ep}", by_role[role].parallel
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
            assert moved > 0 and moved % SLOT_BYTES == 0, (role, moved)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
