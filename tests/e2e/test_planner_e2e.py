"""The SLO planner on a real stack (`pdserve up --planner`'s spec: 1 prefill + 2 decode workers, the planner a
supervised child): a closed-loop load of long prompts with short answers makes prefill the bottleneck; the planner
sees it (the gateway's request statistics, the workers' heartbeats), switches one decode worker to prefill through
the role control, and every request completes, token for token as the single-process engine writes it. /plan
shows the decision with the signals behind it; /metrics the wanted counts."""

from __future__ import annotations

import time

import httpx
import pytest

from services.local.cluster_state import heartbeats
from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos import SteadyLoad
from tests.e2e.test_faults import FAST, LONG
from tests.e2e_support import start_stack

pytestmark = pytest.mark.slow  # a 3-worker stack under load until the planner acts (~1-2 min on 2 cores)

MAX_TOKENS = 4  # prefill-heavy: long prompts, short answers


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, str]:
    """The single-process engine's greedy answers: what every request must reproduce, whichever split served it."""
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=2048)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([tok.encode(p) for p in LONG], params)
    return {p: tok.decode(out) for p, out in zip(LONG, outputs, strict=True)}


def roles(stack) -> dict[str, int]:
    counts: dict[str, int] = {}
    for beat in heartbeats(stack.nats_url).values():
        counts[beat.role.value] = counts.get(beat.role.value, 0) + 1
    return counts


def test_the_planner_moves_a_decode_worker_to_prefill_under_a_prefill_heavy_load(model_dir, reference):
    planner_flags = ("--interval-s", "1", "--confirm-intervals", "2", "--cooldown-s", "5", "--ttft-slo-ms", "300")
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=2, threads_per_worker=1, env=FAST,
                     planner=True, planner_args=planner_flags)  # fmt: skip
    stack = start_stack(spec)
    try:
        plan_url = f"http://{spec.host}:{stack.planner_port}/plan"
        load = SteadyLoad(stack.url, LONG, MAX_TOKENS, clients=4)
        deadline = time.monotonic() + 120
        switches: list[dict] = []
        while time.monotonic() < deadline and not switches:
            time.sleep(1)
            switches = [s for s in httpx.get(plan_url, timeout=10).json()["switches"] if s["result"] == "done"]
        time.sleep(3)  # a few more requests served by the new split
        outcomes = [o for _, _, o in load.stop()]
        plan = httpx.get(plan_url, timeout=10).json()
        metrics = httpx.get(f"http://{spec.host}:{stack.planner_port}/metrics", timeout=10).text
        after = roles(stack)
    finally:
        stack.stop()
    assert switches, f"no switch in 120 s; the planner's last decision: {plan['latest']}"
    assert (switches[0]["from"], switches[0]["to"]) == ("decode", "prefill")
    assert after == {"prefill": 2, "decode": 1}
    decided = [h for h in plan["history"] if h["action"] == "switch"][0]
    assert decided["current"] == {"prefill": 1, "decode": 2} and decided["best"]["prefill"] >= 2
    assert decided["forecast"]["rate"] > 0 and decided["forecast"]["prompt_p90"] > 100  # the gateway's statistics
    assert decided["costs"]["prefill_tokens_per_s"] > 0
    assert 'pdserve:planner_desired_workers{model_name="' in metrics
    assert outcomes and all(o.verdict == "completed" for o in outcomes), [o.error for o in outcomes if o.error]
    assert all(o.text == reference[o.prompt] for o in outcomes)
