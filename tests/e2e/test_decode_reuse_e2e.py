"""Decode-side reuse through the whole stack: a two-turn conversation (turn 2 = turn 1's prompt, its answer and a
new user message, one cache_salt). The decode worker that decoded turn 1 holds its blocks in its prefix cache:
turn 2's decode job goes to it and pulls only the blocks it lacks (the decode worker's
`kv_transfer_skipped_blocks` and `kv_transfer_bytes` say how many), and every answer equals the single-process
engine's. With decode_kv_reuse off, the whole KV is pulled."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import scraped_total, start_stack

MAX_TOKENS = 8
SALT = "conversation-7"
BLOCK_SIZE = 16  # the workers' default (EngineConfig.block_size)


def _complete(url: str, prompt: list[int]) -> str:
    """The stack's greedy answer (text) to `prompt`, given as token ids: turn 2 holds turn 1's answer exactly as
    the reference engine sampled it (the stack's text is checked against the same tokens' text)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "cache_salt": SALT}  # fmt: skip
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def conversation(model_dir):
    """Turn 1 and turn 2 (token ids) and the reference answers (text), from one engine."""
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    turn1 = tok.encode("You are a careful assistant. Here are the rules of the house, read them well. " * 4)
    answer1 = engine.generate([turn1], params)[0]
    turn2 = turn1 + answer1 + tok.encode(" Now, which rule matters most, and why?")
    answer2 = engine.generate([turn2], params)[0]
    return turn1, turn2, tok.decode(answer1), tok.decode(answer2)


def _decode_totals(stack, name: str) -> list[float]:
    return [scraped_total(u, f"pdserve:{name}", role="decode") for u in stack.metrics_urls()]


def _delta(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize("decode_workers,reuse", [(1, True), (2, True), (1, False)])
def test_the_next_turn_pulls_only_what_the_decode_cache_lacks(model_dir, conversation, decode_workers, reuse):
    turn1, turn2, answer1, answer2 = conversation
    env = {"PDSERVE_DECODE_KV_REUSE": "true" if reuse else "false"}
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=decode_workers,
                     threads_per_worker=1, env=env)  # fmt: skip
    stack = start_stack(spec)
    try:
        assert _complete(stack.url, turn1) == answer1
        time.sleep(1.0)  # the decode worker's blocks announced, a heartbeat or two
        pulled1 = _decode_totals(stack, "kv_transfer_bytes_total")
        generated1 = _decode_totals(stack, "generation_tokens_total")
        holder = max(range(len(generated1)), key=lambda i: generated1[i])  # the decode worker of turn 1
        skipped0 = _decode_totals(stack, "kv_transfer_skipped_blocks_total")

        assert _complete(stack.url, turn2) == answer2

        skipped = _delta(_decode_totals(stack, "kv_transfer_skipped_blocks_total"), skipped0)
        pulled2 = _delta(_decode_totals(stack, "kv_transfer_bytes_total"), pulled1)
        bytes_per_block = pulled1[holder] / math.ceil(len(turn1) / BLOCK_SIZE)
        routes = scraped_total(f"{stack.url}/metrics", "pdserve:decode_routes_total")
        if not reuse:
            assert sum(skipped) == 0 and routes == 0
            assert sum(pulled2) == math.ceil(len(turn2) / BLOCK_SIZE) * bytes_per_block
            return
        # the decode worker cached turn 1's prompt and answer but the last answer token (never computed there)
        cached = (len(turn1) + MAX_TOKENS - 1) // BLOCK_SIZE
        assert cached > 0
        assert skipped[holder] == cached and sum(skipped) == cached  # turn 2 went to the holder
        assert pulled2[holder] == (math.ceil(len(turn2) / BLOCK_SIZE) - cached) * bytes_per_block
        assert routes == 1  # turn 2's decode job went to the holder's own queue (turn 1's: the shared one)
    finally:
        stack.stop()
