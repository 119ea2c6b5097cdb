"""Decode routed by expert affinity through the whole stack (one prefill worker, two decode workers): with the
gateway's expert_affinity_routing on, once both decode workers publish hot experts, every fresh prompt's prefill
worker hands its decode job to one of them by the experts its prompt activated (counted as `matched`); off, none
is (the shared queue). Either way every answer equals the single-process engine's: the switch changes routing,
never tokens."""

from __future__ import annotations

import time

import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos import Load
from tests.e2e_support import heartbeats, scraped_total, start_stack

pytestmark = pytest.mark.slow  # two stacks of three workers (make test-slow)

MAX_TOKENS = 12
# every prompt starts differently: no two share a first KV block, so no decode worker's cache holds any of a fresh one
# (KV reuse would route it first, and affinity is not consulted)
NAMES = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo", "Kit"]
FIRST = [f"{n} asks: the decode workers learn their hot experts from requests like this one." for n in NAMES[:6]]
SECOND = [f"{n} wonders which decode worker's experts match the experts of this question best. " * 2 for n in NAMES[6:]]


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, str]:
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = FIRST + SECOND
    outputs = engine.generate([tok.encode(p) for p in prompts], params)
    return {p: tok.decode(o) for p, o in zip(prompts, outputs, strict=True)}


def _completed(url: str, prompts: list[str], reference: dict[str, str]) -> None:
    for o in Load(url, prompts, MAX_TOKENS).results():
        assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
        assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"


@pytest.mark.parametrize("on", [True, False], ids=["affinity-on", "affinity-off"])
def test_the_affinity_switch_changes_routing_and_never_tokens(model_dir, reference, on: bool) -> None:
    env = {"PDSERVE_EXPERT_AFFINITY_ROUTING": "true" if on else "false"}
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=2, threads_per_worker=1, env=env)
    stack = start_stack(spec)
    try:
        assert stack.nats_url is not None
        hot: dict[str, bool] = {}
        for _ in range(3):  # until both decode workers decoded something (the shared queue spreads the first wave)
            _completed(stack.url, FIRST, reference)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                beats = heartbeats(stack.nats_url).values()
                hot = {b.worker_id: b.hot_experts is not None for b in beats if b.role.value == "decode"}
                if len(hot) == 2 and all(hot.values()):
                    break
                time.sleep(0.5)
            if len(hot) == 2 and all(hot.values()):
                break
        assert len(hot) == 2 and all(hot.values()), f"decode workers without hot experts: {hot}"

        _completed(stack.url, SECOND, reference)
        matched = sum(scraped_total(u, "pdserve:decode_affinity_routes_total", outcome="matched")
                      for u in stack.metrics_urls())  # fmt: skip
        if on:  # fresh prompts (no decode cache holds them), two candidates with hot experts: routed by affinity
            assert matched >= len(SECOND), matched
        else:
            assert matched == 0
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
