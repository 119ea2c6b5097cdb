"""KV-aware routing through the whole stack: two real prefill workers with the engine's prefix cache, one decode
worker, the gateway routing by the blocks they announce. Prompts that share a long prefix all go to the prefill
worker that computed it first (the gateway's `prefill_routes{how="prefix"}` and that worker's prompt tokens
say so), each of them answers with the cached part of its prompt in `usage.prompt_tokens_details.cached_tokens`,
and every answer equals the single-process engine's; with routing off they go to the shared queue."""

from __future__ import annotations

import time

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import scraped_total, start_stack

SHARED_PREFIX = "You are a careful assistant. Here are the rules of the house, read them well. " * 6
SUFFIXES = ["What is rule one?", "Summarize them.", "Which rule matters most?", "Say it in French."]
MAX_TOKENS = 8


def _complete(url: str, prompt: str) -> tuple[str, int]:
    """The completion's text and its prompt tokens served from a prefix cache."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def reference(model_dir):
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [SHARED_PREFIX + s for s in SUFFIXES]
    outs = engine.generate([tok.encode(p) for p in prompts], params)
    return {p: tok.decode(o) for p, o in zip(prompts, outs, strict=True)}


def _prefill_prompt_tokens(stack) -> list[float]:
    return [scraped_total(u, "pdserve:prompt_tokens_total", role="prefill") for u in stack.metrics_urls()]


@pytest.mark.parametrize("routing", ["on", "off"])
def test_prompts_sharing_a_prefix_go_to_the_worker_that_holds_it(model_dir, reference, routing):
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=2, decode=1, threads_per_worker=1,
                     env={"PDSERVE_KV_AWARE_ROUTING": "true" if routing == "on" else "false"})  # fmt: skip
    stack = start_stack(spec)
    try:
        metrics = f"{stack.url}/metrics"
        first, *rest = [SHARED_PREFIX + s for s in SUFFIXES]
        assert _complete(stack.url, first) == (reference[first], 0)
        time.sleep(1.0)  # the blocks announced, a heartbeat or two
        before = _prefill_prompt_tokens(stack)
        holder = max(range(len(before)), key=lambda i: before[i])  # the worker that computed the prefix
        cached = []
        for prompt in rest:
            text, hit = _complete(stack.url, prompt)
            assert text == reference[prompt]
            cached.append(hit)
        grown = [a - b for a, b in zip(_prefill_prompt_tokens(stack), before, strict=True)]
        routed = scraped_total(metrics, "pdserve:prefill_routes_total", how="prefix")
        if routing == "on":
            assert routed == len(rest)
            assert scraped_total(metrics, "pdserve:routed_prefix_hit_tokens_total") > 0
            assert all(g == 0 for i, g in enumerate(grown) if i != holder)  # all to the holder
            shared_blocks = len(Tokenizer(model_dir).encode(SHARED_PREFIX)) // 16  # the engine's block size
            assert all(hit >= (shared_blocks - 1) * 16 for hit in cached), cached  # the prefix, block-aligned
        else:
            assert routed == 0
            assert scraped_total(metrics, "pdserve:prefill_routes_total", how="shared") == len(SUFFIXES)
    finally:
        stack.stop()
