"""Layer-streamed KV hand-off through the real stack (gateway, one prefill and one decode worker, NATS, Redis,
the KV pull) with PDSERVE_KV_STREAM_LAYERS on: the prefill worker publishes the decode job as the prompt's last
chunk starts, the decode worker pulls the KV layer by layer and emits the first token it got in the pull's
trailer (docs/kv_transfer.md, "Layer-by-layer streaming").

Proven here: greedy output equals the single-process engine's (what `pdserve generate` runs), the KV was
streamed (the prefill worker's `kv_layer_streamed_pulls` counts every streamed job, none other) and never
recomputed (the decode worker's heartbeat reports no prefill tokens); max_tokens 1 (not streamed) and a stop
on the first token (streamed: the decode worker ends it) finish right, a client leaving mid-stream frees
everything; a send broken midway (the fault switch)
makes decode recompute and sample the first token itself, with the same output, each token counted once (by
the decode worker, which emitted it). Every block is freed and no
Redis key left on both sides."""

from __future__ import annotations

import time

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import heartbeats, kv_keys, scraped_total, start_stack

PROMPTS = ["The quick brown fox", "Tell me a story about disaggregation " * 6]
MAX_TOKENS = 16
STREAM = {"PDSERVE_KV_STREAM_LAYERS": "1"}

pytestmark = pytest.mark.slow  # two stacks: ~140 s on the shared 2-core machine


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[int]]:
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return dict(zip(PROMPTS, engine.generate([tok.encode(p) for p in PROMPTS], params), strict=True))


def _stack(model_dir, env: dict[str, str]) -> Stack:
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, prefill=1, decode=1, env=env)
    return start_stack(spec)


def _complete(client: httpx.Client, url: str, prompt: str, **fields) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = client.post(f"{url}/v1/completions", json=body | fields)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _streamed_pulls(stack: Stack) -> float:
    return sum(scraped_total(url, "pdserve:kv_layer_streamed_pulls_total") for url in stack.metrics_urls())


def _idle_beats(stack: Stack) -> dict:
    """Heartbeats once both workers hold nothing (or after 20 s: the caller's asserts say what is left)."""
    assert stack.nats_url is not None  # set once started
    deadline = time.monotonic() + 20
    while True:
        beats = heartbeats(stack.nats_url, seconds=1.2)
        idle = all(b.running == 0 and b.held_kv == 0 and b.free_blocks == b.total_blocks for b in beats.values())
        if idle or time.monotonic() > deadline:
            return beats


def _check_freed(stack: Stack, beats: dict) -> tuple:
    prefill = [b for b in beats.values() if b.role == "prefill"]
    decode = [b for b in beats.values() if b.role == "decode"]
    assert len(prefill) == 1 and len(decode) == 1
    assert all(b.running == 0 and b.held_kv == 0 and b.free_blocks == b.total_blocks for b in beats.values()), beats
    assert all(b.integrity_error is None for b in beats.values())
    assert stack.redis_url is not None and kv_keys(stack.redis_url) == []
    return prefill[0], decode[0]


def test_streamed_hand_off_equals_the_engine_and_decode_emits_the_first_token(model_dir, reference):
    tok = Tokenizer(model_dir)
    stack = _stack(model_dir, STREAM)
    try:
        with httpx.Client(timeout=120) as client:
            for prompt in PROMPTS:
                out = _complete(client, stack.url, prompt)["choices"][0]
                assert out["text"] == tok.decode(reference[prompt]) and out["finish_reason"] == "length"
            # max_tokens 1 ends at the prefill: not streamed, the prefill worker emits it as always
            one = _complete(client, stack.url, PROMPTS[0], max_tokens=1)
            assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] == "length"
            # a stop on the first token: streamed; the decode worker sees the trailer's token end it
            first = reference[PROMPTS[1]][0]
            stop = _complete(client, stack.url, PROMPTS[1], stop_token_ids=[first])
            assert stop["usage"]["completion_tokens"] == 1 and stop["choices"][0]["finish_reason"] == "stop"
            # a client that leaves mid-stream: the cancel reaches the decode worker, which frees everything
            body = {"model": "demo", "prompt": "cancel me", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i > 6:
                        break
        assert _streamed_pulls(stack) == len(PROMPTS) + 2  # every streamable job, each pulled once
        prefill, decode = _check_freed(stack, _idle_beats(stack))
        assert decode.prefill_tokens == 0  # the decode worker never ran a prompt: every KV was pulled
        assert decode.decode_tokens >= len(PROMPTS) * (MAX_TOKENS - 2)
        assert prefill.decode_tokens == 0
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()


def test_a_broken_streamed_send_is_recomputed_by_decode(model_dir, reference):
    """Every send stops after its first piece (4 KiB chunks: a layer is several): the stream fails mid-way,
    the decode worker recomputes the prompt and samples the first token itself; the client sees one stream."""
    tok = Tokenizer(model_dir)
    fault = {"PDSERVE_FAULT_KV_SEND_MIDWAY": "1", "PDSERVE_KV_CHUNK_BYTES": "4096", "PDSERVE_KV_SHM_BYTES": "0"}
    stack = _stack(model_dir, STREAM | fault)
    try:
        with httpx.Client(timeout=120) as client:
            for prompt in PROMPTS:
                out = _complete(client, stack.url, prompt)["choices"][0]
                assert out["text"] == tok.decode(reference[prompt])
        assert _streamed_pulls(stack) == len(PROMPTS)  # streamed, and broken
        # each first token counted once, by the decode worker that sampled and emitted it (the prefill's is unseen)
        generated = {role: sum(scraped_total(url, "pdserve:generation_tokens_total", role=role)
                               for url in stack.metrics_urls()) for role in ("prefill", "decode")}  # fmt: skip
        assert generated == {"prefill": 0, "decode": len(PROMPTS) * MAX_TOKENS}
        prefill, decode = _check_freed(stack, _idle_beats(stack))
        ids = [tok.encode(p) for p in PROMPTS]
        assert decode.prefill_tokens >= sum(map(len, ids))  # recomputed there
        assert prefill.prefill_tokens >= sum(map(len, ids))
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
