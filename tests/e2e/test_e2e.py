"""The whole stack as users run it: nats-server, redis-server, gateway, prefill and decode workers as real
processes (started by the same launcher as `pdserve up`), driven over HTTP."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.e2e_support import heartbeats, kv_keys, scraped_total, start_stack

PROMPTS = ["The quick brown fox", "héllo wörld, 世界", "a", "Tell me a story about disaggregation " * 6]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy outputs of the single-process engine: what every topology must reproduce."""
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [tok.encode(p) for p in PROMPTS]
    return dict(zip(PROMPTS, engine.generate(ids, params), strict=True))


def _stack(model_dir, **kw) -> Stack:
    return start_stack(StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, **kw))


def _complete(url: str, prompt: str, stream: bool = False, **extra) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream} | extra  # fmt: skip
    with httpx.Client(timeout=120) as client:
        if not stream:
            resp = client.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()
        chunks = []
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            raw = resp.read().decode()
        assert "\r" not in raw
        for event in raw.split("\n\n"):
            if event.strip():
                assert event.startswith("data: ")
                chunks.append(event[len("data: ") :])
        assert chunks[-1] == "[DONE]"
        return {"chunks": [json.loads(c) for c in chunks[:-1]]}


def test_completions_match_single_process_engine(stack, model_dir, reference):
    tok = Tokenizer(model_dir)
    for prompt in PROMPTS:
        out = _complete(stack.url, prompt)
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
        assert out["usage"]["prompt_tokens"] == len(tok.encode(prompt))
        assert out["choices"][0]["text"] == tok.decode(reference[prompt])
        assert out["choices"][0]["finish_reason"] == "length"


def test_streaming_is_ordered_and_complete(stack, model_dir, reference):
    tok = Tokenizer(model_dir)
    prompt = PROMPTS[0]
    chunks = _complete(stack.url, prompt, stream=True)["chunks"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == tok.decode(reference[prompt])
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_matches_engine(stack, model_dir):
    tok = Tokenizer(model_dir)
    messages = [{"role": "user", "content": "hi there"}]
    ids = tok.encode_chat(messages)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    expected = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    with httpx.Client(timeout=120) as client:
        resp = client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": "demo",
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["content"] == tok.decode(expected)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_concurrent_requests_all_complete_and_kv_moved(stack, model_dir, reference):
    tok = Tokenizer(model_dir)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _complete(stack.url, p, stream=True), prompts))
    for prompt, result in zip(prompts, results, strict=True):
        text = "".join(c["choices"][0]["text"] for c in result["chunks"] if c["choices"])
        assert text == tok.decode(reference[prompt])

    time.sleep(0.5)
    beats = heartbeats(stack.nats_url)
    prefill = [b for b in beats.values() if b.role == "prefill"]
    decode = [b for b in beats.values() if b.role == "decode"]
    assert len(prefill) == 1 and len(decode) == 1
    # The decode worker never ran a prompt: every request's KV was pulled, none recomputed.
    assert decode[0].prefill_tokens == 0
    assert decode[0].decode_tokens >= 16 * (MAX_TOKENS - 1)
    # The prefill worker computed every prompt and holds nothing afterwards.
    assert prefill[0].prefill_tokens > 0 and prefill[0].decode_tokens == 0
    assert prefill[0].held_kv == 0 and prefill[0].free_blocks == prefill[0].total_blocks
    assert prefill[0].integrity_error is None and decode[0].integrity_error is None  # check_integrity()
    assert decode[0].free_blocks == decode[0].total_blocks
    assert kv_keys(stack.redis_url) == []
    # On one host every pull takes a same-host path, and the metric by transport says so (across hosts none does:
    # tests/e2e/test_across_hosts.py)
    decode_url = stack.metrics_urls()[1]
    same_host = sum(scraped_total(decode_url, "pdserve:kv_pulls_total", transport=t) for t in ("borrowed", "segment"))
    assert same_host == scraped_total(decode_url, "pdserve:kv_transfer_seconds_count", role="decode") > 0


def test_without_shared_memory_every_pull_arrives_in_posted_receives(model_dir, reference):
    """As between two hosts (no shared segment): the decode worker posts its receives before each pull, over
    the pair's PullStream (shared/kv/transfer/posted.py, pull_stream.py), and the text is the engine's."""
    tok = Tokenizer(model_dir)
    stack = _stack(model_dir, prefill=1, decode=1, env={"PDSERVE_KV_SHM_BYTES": "0"})
    try:
        for prompt in PROMPTS:
            assert _complete(stack.url, prompt)["choices"][0]["text"] == tok.decode(reference[prompt])
        urls = stack.metrics_urls()
        pulls = sum(scraped_total(u, "pdserve:kv_transfer_seconds_count", role="decode") for u in urls)
        posted = sum(scraped_total(u, "pdserve:kv_posted_pulls_total", role="prefill") for u in urls)
        failed = sum(scraped_total(u, "pdserve:kv_transfer_failures_total") for u in urls)
        assert (pulls, posted, failed) == (len(PROMPTS), len(PROMPTS), 0)
        assert heartbeats(stack.nats_url) and all(
            b.prefill_tokens == 0 for b in heartbeats(stack.nats_url).values() if b.role == "decode"
        )
    finally:
        stack.stop()


def test_openai_client(stack, model_dir, reference):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    tok = Tokenizer(model_dir)
    prompt = PROMPTS[1]
    kwargs = dict(model="demo", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    done = client.completions.create(prompt=prompt, **kwargs)
    assert done.choices[0].text == tok.decode(reference[prompt])
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kwargs))
    assert streamed == done.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == MAX_TOKENS
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_client_disconnect_frees_kv_everywhere(stack):
    generated_before = _generated_tokens(stack)
    body = {"model": "demo", "prompt": "cancel me", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 6:
                    break  # leave mid-stream
    deadline = time.monotonic() + 20
    while True:
        beats = heartbeats(stack.nats_url, seconds=1.2)
        idle = all(
            b.running == 0 and b.held_kv == 0 and b.free_blocks == b.total_blocks and b.integrity_error is None
            for b in beats.values()
        )
        if idle or time.monotonic() > deadline:
            break
    assert idle, beats
    assert kv_keys(stack.redis_url) == []
    # the cancel stopped generation: ignore_eos would have run all 1000 tokens otherwise
    generated = _generated_tokens(stack) - generated_before
    assert generated < 500, f"{generated} tokens generated after the client left at the 7th line"


def test_cancel_frees_the_kv_a_prefill_worker_holds(model_dir):
    """The client leaves while the prefill worker holds the request's KV for a decode worker that is paused (so
    nobody pulls it): the cancel frees the blocks and the Redis entry well before the KV lease would."""
    stack = _stack(model_dir, prefill=1, decode=1)
    (decode,) = (proc for name, proc in stack.procs.items() if name.startswith("decode"))
    try:
        decode.send_signal(signal.SIGSTOP)
        body = {"model": "demo", "prompt": "hold me", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                lines = resp.iter_lines()  # kept: a closed line iterator closes the connection (a disconnect)
                next(line for line in lines if line.startswith("data:"))  # the first token: prefilled
                held = _prefill_beat(stack, lambda b: b.held_kv == 1)
                assert held.held_kv == 1 and held.free_blocks < held.total_blocks, held
                assert len(kv_keys(stack.redis_url)) == 1
        freed = _prefill_beat(stack, lambda b: b.held_kv == 0 and b.free_blocks == b.total_blocks, timeout_s=10)
        assert freed.held_kv == 0 and freed.free_blocks == freed.total_blocks, freed  # the lease is 30 s
        assert kv_keys(stack.redis_url) == []
    finally:
        decode.send_signal(signal.SIGCONT)
        stack.stop()


def _prefill_beat(stack: Stack, wanted, timeout_s: float = 20.0):
    """The prefill worker's latest heartbeat once `wanted(beat)` holds (or the last one seen at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beat = next(b for b in heartbeats(stack.nats_url, seconds=1.2).values() if b.role == "prefill")
        if wanted(beat) or time.monotonic() > deadline:
            return beat


def test_bad_input_keeps_the_stack_serving(stack):
    with httpx.Client(timeout=60) as client:
        for body in ({"model": "demo"}, {"model": "nope", "prompt": "x"}, {"model": "demo", "prompt": "x", "n": 17}):
            resp = client.post(f"{stack.url}/v1/completions", json=body)
            assert 400 <= resp.status_code < 500 and "error" in resp.json()
        resp = client.post(
            f"{stack.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert 400 <= resp.status_code < 500
    assert _complete(stack.url, "still fine")["usage"]["completion_tokens"] == MAX_TOKENS


def test_tracing_off_by_default_and_quiet(stack):
    """No OTEL_* set: no service turned tracing on, and nothing logged an error along the way."""
    logs = stack.logs()
    assert "tracing on" not in logs
    assert "Traceback" not in logs and " ERROR " not in logs, logs


def _generated_tokens(stack: Stack) -> float:
    """pdserve:generation_tokens_total summed over every worker's /metrics."""
    return sum(scraped_total(url, "pdserve:generation_tokens_total") for url in stack.metrics_urls())


@pytest.mark.parametrize(
    "topology",
    [
        # Four workers and a gateway on two cores: over a minute to start and serve (make test-slow).
        pytest.param(dict(prefill=2, decode=2), id="2p2d", marks=pytest.mark.slow),
        pytest.param(dict(mixed=1, prefill=0, decode=0), id="mixed", marks=pytest.mark.slow),
    ],
)
def test_other_topologies_match(model_dir, reference, topology):
    tok = Tokenizer(model_dir)
    stack = _stack(model_dir, **topology)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: _complete(stack.url, p), prompts))
        for prompt, out in zip(prompts, results, strict=True):
            assert out["choices"][0]["text"] == tok.decode(reference[prompt])
        try:
            generated = _generated_tokens(stack)
        except httpx.ConnectError as exc:  # a worker's /metrics is gone: say which and why
            states = {name: proc.poll() for name, proc in stack.procs.items()}
            raise AssertionError(f"scraping failed ({exc}); exit codes {states}\n{stack.logs()}") from exc
        assert generated == len(prompts) * MAX_TOKENS  # whichever workers sampled them
        beats = heartbeats(stack.nats_url)
        assert all(b.prefill_tokens == 0 for b in beats.values() if b.role == "decode")
        assert kv_keys(stack.redis_url) == []
    finally:
        stack.stop()
