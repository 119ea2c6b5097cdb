"""DeepSeek-V3 disaggregated through the real stack: the latent KV cache (one [c_kv | k_pe] entry per token,
shared by every head) is what moves from the prefill worker to the decode worker."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from services.cli import main
from services.demo_model import write_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import heartbeats, kv_keys, scraped_total, start_stack

PROMPTS = ["The quick brown fox", "Tell me a story about latent attention " * 5, "a"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("deepseek") / "demo", arch="deepseek_v3", size="tiny")


@pytest.fixture(scope="module")
def stack(deepseek_dir):
    stack = start_stack(StackSpec(model=str(deepseek_dir), port=free_port(), threads_per_worker=1, prefill=1, decode=1))
    yield stack
    stack.stop()


def _generate_cli(model_dir, prompt: str, capsys) -> str:
    """What `pdserve generate` writes for the prompt (greedy, the full length)."""
    args = ["generate", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", prompt]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_disaggregated_deepseek_v3_equals_generate_and_moves_the_latent(stack, deepseek_dir, capsys):
    expected = {p: _generate_cli(deepseek_dir, p, capsys) for p in PROMPTS}
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            resp = client.post(f"{stack.url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected[prompt]

    time.sleep(0.5)  # the next heartbeats carry the final counters
    beats = heartbeats(stack.nats_url)
    (prefill,) = [b for b in beats.values() if b.role == "prefill"]
    (decode,) = [b for b in beats.values() if b.role == "decode"]
    assert decode.prefill_tokens == 0  # the decode worker never ran a prompt: every latent KV was pulled
    assert prefill.held_kv == 0 and prefill.free_blocks == prefill.total_blocks  # freed on the prefill side
    assert decode.free_blocks == decode.total_blocks  # and on the decode side, once the requests finished
    assert prefill.integrity_error is None and decode.integrity_error is None
    assert kv_keys(stack.redis_url) == []

    # The bytes pulled are the latent cache's: (L, 1, n, B, 1, kv_lora_rank + rope) per request, half of what a
    # K|V cache with one head of that width would move, and no per-head copies.
    layout = Engine.from_dir(deepseek_dir, max_model_len=256).layout
    assert layout.planes == 1 and layout.num_held_kv_heads == 1
    tok = Tokenizer(deepseek_dir)
    expected_bytes = sum(math.ceil(len(tok.encode(p)) / layout.block_size) * layout.bytes_per_block for p in PROMPTS)
    moved = sum(scraped_total(url, "pdserve:kv_transfer_bytes_total", role="decode") for url in stack.metrics_urls())
    assert moved == expected_bytes
