"""n > 1 through the whole stack and the official openai client: each choice equals a single request with its
derived seed (seed + i), reproducibly, streamed or not; the prompt is prefilled once and its KV pulled once;
a client that leaves mid-stream frees every choice's blocks on both sides."""

from __future__ import annotations

import signal
import time

import httpx
import msgspec
import openai
import pytest

from services.local.infra import free_port
from services.local.stack import Stack, StackSpec
from tests.chaos import EventWatch
from tests.e2e_support import heartbeats, kv_keys, scraped_total, start_stack

PROMPT = "Tell me a story about disaggregation, in three parts"
SEED = 1234
N = 3
MAX_TOKENS = 12
SAMPLED = dict(model="demo", max_tokens=MAX_TOKENS, temperature=1.0, extra_body={"ignore_eos": True})


def _stack(model_dir, **kw) -> Stack:
    return start_stack(StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, **kw))


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _singles(client: openai.OpenAI) -> list[str]:
    """What n single requests with the derived seeds answer."""
    return [client.completions.create(prompt=PROMPT, seed=SEED + i, **SAMPLED).choices[0].text for i in range(N)]


def _streamed_texts(stream, chat: bool) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Per choice index: the text and the finish reason of a stream; and every chunk."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_seeded_choices_equal_single_requests_and_repeat(stack):
    client = _client(stack)
    first = client.completions.create(prompt=PROMPT, n=N, seed=SEED, **SAMPLED)
    again = client.completions.create(prompt=PROMPT, n=N, seed=SEED, **SAMPLED)
    assert [c.index for c in first.choices] == list(range(N))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts == _singles(client)
    assert len(set(texts)) > 1  # different seeds: the comparison is not vacuous
    assert all(c.finish_reason == "length" for c in first.choices)
    single_prompt = client.completions.create(prompt=PROMPT, seed=SEED, **SAMPLED).usage.prompt_tokens
    assert first.usage.prompt_tokens == single_prompt  # the prompt once
    assert first.usage.completion_tokens == N * MAX_TOKENS  # summed over the choices

    streamed, reasons, chunks = _streamed_texts(
        client.completions.create(prompt=PROMPT, n=N, seed=SEED, stream=True, **SAMPLED), chat=False
    )
    assert [streamed[i] for i in range(N)] == texts
    assert reasons == dict.fromkeys(range(N), "length")
    assert all(len(c.choices) == 1 for c in chunks)  # one choice per chunk, tagged with its index


def test_chat_choices_stream_with_a_role_each(stack):
    client = _client(stack)
    messages = [{"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(messages=messages, n=N, seed=SEED, **SAMPLED)
    assert [c.index for c in whole.choices] == list(range(N))
    assert all(c.message.role == "assistant" for c in whole.choices)
    stream = client.chat.completions.create(
        messages=messages, n=N, seed=SEED, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    texts, reasons, chunks = _streamed_texts(stream, chat=True)
    assert [texts[i] for i in range(N)] == [c.message.content for c in whole.choices]
    assert reasons == dict.fromkeys(range(N), "length")
    roles = {}
    for chunk in chunks:
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)  # the first chunk of each choice
    assert roles == dict.fromkeys(range(N), "assistant")
    assert chunks[-1].usage.completion_tokens == N * MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    greedy = client.chat.completions.create(messages=messages, n=N, **(SAMPLED | {"temperature": 0.0}))
    assert len({c.message.content for c in greedy.choices}) == 1


def _decode_pulls(stack: Stack) -> float:
    return sum(scraped_total(url, "pdserve:kv_transfer_seconds_count", role="decode") for url in stack.metrics_urls())


def _settled(stack: Stack, timeout_s: float = 20.0) -> dict:
    """Heartbeats once every worker is idle with all blocks free (or the last seen at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats = heartbeats(stack.nats_url, seconds=1.2)
        idle = all(
            b.running == 0 and b.held_kv == 0 and b.free_blocks == b.total_blocks and b.integrity_error is None
            for b in beats.values()
        )
        if idle or time.monotonic() > deadline:
            return beats


def test_the_prompt_is_prefilled_once_and_pulled_once(stack):
    client = _client(stack)
    before = {b.role: b for b in _settled(stack).values()}
    pulls_before = _decode_pulls(stack)
    # a salt of its own: the prefix cache (on by default) would serve the prompt the earlier tests computed
    salted = SAMPLED | {"extra_body": SAMPLED["extra_body"] | {"cache_salt": "prefilled-once"}}
    done = client.completions.create(prompt=PROMPT, n=N, seed=SEED, **salted)
    after = {b.role: b for b in _settled(stack).values()}
    assert after["prefill"].prefill_tokens - before["prefill"].prefill_tokens == done.usage.prompt_tokens
    assert after["decode"].prefill_tokens == before["decode"].prefill_tokens  # nothing recomputed on decode
    assert after["decode"].decode_tokens - before["decode"].decode_tokens == N * (MAX_TOKENS - 1)
    assert _decode_pulls(stack) - pulls_before == 1
    assert all(b.free_blocks == b.total_blocks and b.integrity_error is None for b in after.values())
    assert kv_keys(stack.redis_url) == []


def test_client_disconnect_frees_every_choice(stack):
    body = {"model": "demo", "prompt": "cancel us", "max_tokens": 1000, "n": N, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for i, _ in enumerate(resp.iter_lines()):
                if i > 3 * N * 2:
                    break  # leave mid-stream
    beats = _settled(stack)
    assert all(b.running == 0 and b.held_kv == 0 and b.free_blocks == b.total_blocks for b in beats.values()), beats
    assert all(b.integrity_error is None for b in beats.values())
    assert kv_keys(stack.redis_url) == []


def test_a_mixed_worker_answers_the_same_choices(model_dir, stack):
    """Identical results whether the request ran disaggregated or in one engine."""
    disaggregated = [
        c.text for c in _client(stack).completions.create(prompt=PROMPT, n=N, seed=SEED, **SAMPLED).choices
    ]
    one_worker = _stack(model_dir, prefill=0, decode=0, mixed=1)
    try:
        mixed = _client(one_worker).completions.create(prompt=PROMPT, n=N, seed=SEED, **SAMPLED)
        assert [c.text for c in mixed.choices] == disaggregated
        beat = next(iter(_settled(one_worker).values()))
        assert beat.prefill_tokens == mixed.usage.prompt_tokens  # the prompt once, for three choices
    finally:
        one_worker.stop()


FAST = {  # as tests/e2e/test_faults.py: a worker silent for 2 s is dead
    "PDSERVE_WORKER_TTL_S": "2",
    "PDSERVE_STALL_TIMEOUT_S": "10",
    "PDSERVE_KV_LEASE_S": "4",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "5",
    "PDSERVE_JOB_ACK_WAIT_S": "6",
}
LONG_TOKENS = 1000


@pytest.mark.slow  # a fault stack (two decode workers, one killed mid-stream), like tests/e2e/test_faults.py
def test_every_choice_continues_when_its_decode_worker_dies(model_dir):
    """The decode worker streaming the three choices is killed: the gateway moves each choice on alone (prompt +
    its tokens so far, its own seed) and every choice still equals the single request with its derived seed."""
    stack = start_stack(
        StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=2, threads_per_worker=1, env=FAST)
    )
    watch = EventWatch(stack.nats_url)
    try:
        params = SAMPLED | {"max_tokens": LONG_TOKENS}
        body = {"prompt": PROMPT, "n": N, "seed": SEED, "stream": True, "model": "demo", "temperature": 1.0}
        body |= {"max_tokens": LONG_TOKENS, "ignore_eos": True}
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        killed = None
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for c in msgspec.json.decode(line[len("data: ") :])["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        if c["finish_reason"]:
                            reasons[c["index"]] = c["finish_reason"]
                    if killed is None and len(texts) == N:  # every choice is streaming from a decode worker
                        killed = _holding_decode_worker(stack, watch)
                        stack.procs[killed].send_signal(signal.SIGKILL)
        assert killed is not None and reasons == dict.fromkeys(range(N), "length")
        moved = scraped_total(f"{stack.url}/metrics", "pdserve:request_migrations_total")
        assert moved >= 1  # at least one choice was still running when its worker died
        client = _client(stack)
        singles = [client.completions.create(prompt=PROMPT, seed=SEED + i, **params).choices[0].text for i in range(N)]
        assert [texts[i] for i in range(N)] == singles
    finally:
        watch.close()
        stack.stop()


def _holding_decode_worker(stack: Stack, watch: EventWatch) -> str:
    """The stack name of the decode worker holding unfinished requests now (worker ids are "<name>-<pid>")."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for worker in watch.holders().values():
            name = next((n for n in stack.procs if worker.startswith(f"{n}-")), "")
            if name.startswith("decode"):
                return name
        time.sleep(0.01)
    raise AssertionError("no decode worker holds the choices")


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_disconnect_frees_the_group_kv_a_prefill_worker_holds(model_dir):
    """The client leaves while the prefill worker holds the prompt KV of three choices for a decode worker that is
    paused: the choices' cancels free the blocks and the Redis entry well before the lease would."""
    stack = _stack(model_dir, prefill=1, decode=1)
    (decode,) = (proc for name, proc in stack.procs.items() if name.startswith("decode"))
    try:
        decode.send_signal(signal.SIGSTOP)
        body = {"model": "demo", "prompt": "hold us", "max_tokens": 100, "n": N, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                lines = resp.iter_lines()  # kept: a closed line iterator closes the connection (a disconnect)
                firsts = _first_lines(lines, N)
                assert len(firsts) == N  # every choice's first token: prefilled
                held = _prefill_beat(stack, lambda b: b.held_kv == 1)
                assert held.held_kv == 1 and held.free_blocks < held.total_blocks, held  # one KV for three
                assert len(kv_keys(stack.redis_url)) == 1
        freed = _prefill_beat(stack, lambda b: b.held_kv == 0 and b.free_blocks == b.total_blocks, timeout_s=10)
        assert freed.held_kv == 0 and freed.free_blocks == freed.total_blocks, freed  # the lease is 30 s
        assert kv_keys(stack.redis_url) == []
    finally:
        decode.send_signal(signal.SIGCONT)
        stack.stop()


def _first_lines(lines, n: int) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data:"):
            out.append(line)
            if len(out) == n:
                break
    return out


def _prefill_beat(stack: Stack, wanted, timeout_s: float = 20.0):
    """The prefill worker's latest heartbeat once `wanted(beat)` holds (or the last one seen at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beat = next(b for b in heartbeats(stack.nats_url, seconds=1.2).values() if b.role == "prefill")
        if wanted(beat) or time.monotonic() > deadline:
            return beat
