"""`pdserve bench` workloads for prefix reuse (services/bench/prefix_workloads.py) and the cached-token
accounting: the shared prefix is the same tokens in every request of its group (completions and chat), the
generators are seeded, the request bodies carry a conversation's history, and cached_tokens from the usage chunk
becomes the summary's hit rate."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from services.bench.client import request_body, send
from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestRecord, summarize
from services.bench.prefix_workloads import (
    Conversation,
    multi_turn_conversations,
    prompt_share,
    shared_prefix_requests,
)
from services.bench.report import format_table


def _groups(reqs: list[BenchRequest]) -> dict[str, list[BenchRequest]]:
    groups: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        groups.setdefault(r.prefix, []).append(r)
    return groups


def test_shared_prefix_groups_lengths_and_order(tokenizer):
    reqs = shared_prefix_requests(tokenizer, num_groups=3, num_prompts=10, prefix_len=60, suffix_len=12,
                                  output_len=5, seed=2)  # fmt: skip
    groups = _groups(reqs)
    assert len(groups) == 3 and sorted(len(g) for g in groups.values()) == [3, 3, 4]  # 10 spread over 3
    assert {(r.prefix_len, r.prompt_len, r.output_len) for r in reqs} == {(60, 72, 5)}
    assert all(len(tokenizer.encode(r.prefix + r.prompt)) == r.prompt_len for r in reqs)
    assert all(len({r.prompt for r in g}) == len(g) for g in groups.values())  # every suffix its own
    # interleaved: the send order is not group after group
    sequence = [list(groups).index(r.prefix) for r in reqs]
    assert sequence != sorted(sequence)
    assert prompt_share(reqs) == pytest.approx(60 / 72)


def test_shared_prefix_is_seeded(tokenizer):
    def build(seed):
        return shared_prefix_requests(tokenizer, 2, 6, prefix_len=20, suffix_len=4, output_len=3, seed=seed)

    assert build(5) == build(5)
    assert build(5) != build(6)


def test_shared_prefix_refuses_fewer_prompts_than_groups(tokenizer):
    with pytest.raises(ValueError, match="num_prompts"):
        shared_prefix_requests(tokenizer, num_groups=4, num_prompts=3, prefix_len=8, suffix_len=2, output_len=1)


def test_prefix_tokens_are_identical_across_a_group_completions_and_chat(tokenizer):
    """What a prefix cache needs: every request of a group opens with the same token ids, as the server tokenizes
    it — the completions prompt (prefix + suffix), and the chat template's rendering (prefix as system message)."""
    reqs = shared_prefix_requests(tokenizer, 2, 8, prefix_len=40, suffix_len=6, output_len=2, seed=0)
    for group in _groups(reqs).values():
        first = group[0]
        prefix_ids = tokenizer.encode(first.prefix)
        for r in group:
            assert tokenizer.encode(r.prefix + r.prompt)[: len(prefix_ids)] == prefix_ids
        chats = [tokenizer.encode_chat(request_body("m", "chat", r)["messages"]) for r in group]
        system_part = tokenizer.encode_chat([{"role": "system", "content": first.prefix}], add_generation_prompt=False)
        assert all(ids[: len(system_part)] == system_part for ids in chats)
        assert len(system_part) > len(prefix_ids)  # the template's own tokens around it are shared too


def _merging_bpe():
    """A byte-level BPE trained with merges, so decoded random ids can merge at the prefix/suffix boundary."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "shared prefixes, cached and reused"] * 50
    trainer = trainers.BpeTrainer(vocab_size=350, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    hf.train_from_iterator(corpus, trainer)

    class Wrapped:
        vocab_size = hf.get_vocab_size()
        encode = staticmethod(lambda text: hf.encode(text).ids)
        decode = staticmethod(lambda ids: hf.decode(ids))

    return Wrapped()


def test_prefix_survives_a_merging_tokenizer():
    tok = _merging_bpe()
    reqs = shared_prefix_requests(tok, 3, 30, prefix_len=50, suffix_len=10, output_len=1, seed=1)
    for r in reqs:
        prefix_ids = tok.encode(r.prefix)
        ids = tok.encode(r.prefix + r.prompt)
        assert ids[: len(prefix_ids)] == prefix_ids and len(ids) == r.prompt_len and r.prefix_len == len(prefix_ids)


class MergingToy:
    """Tokens a, b, c and the merge "ab": a prefix ending in "a" loses its last token to a suffix opening with "b"."""

    vocab_size = 4
    pieces = ("a", "b", "c", "ab")

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(3)
                i += 2
            else:
                ids.append("abc".index(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_a_suffix_that_would_merge_into_the_prefix_is_drawn_again():
    tok = MergingToy()
    reqs = shared_prefix_requests(tok, 12, 120, prefix_len=9, suffix_len=5, output_len=1, seed=0)
    exposed = [r for r in reqs if r.prefix.endswith("a")]
    assert len({r.prefix for r in exposed}) >= 2  # the case arises
    assert not any(r.prompt.startswith("b") for r in exposed)  # ... and every such suffix was replaced
    assert all(tok.encode(r.prefix + r.prompt)[: r.prefix_len] == tok.encode(r.prefix) for r in reqs)


def test_multi_turn_conversations(tokenizer):
    convs = multi_turn_conversations(tokenizer, num_conversations=3, num_turns=4, input_len=9, output_len=7,
                                     think_s=0.5, seed=3)  # fmt: skip
    assert len(convs) == 3 and all(len(c.turns) == 4 and c.think_s == 0.5 and c.at_s is None for c in convs)
    turns = [t for c in convs for t in c.turns]
    assert {(t.prompt_len, t.output_len, t.kind) for t in turns} == {(9, 7, "multi-turn")}
    assert len({t.prompt for t in turns}) == 12
    assert convs == multi_turn_conversations(tokenizer, 3, 4, 9, 7, 0.5, seed=3)
    assert convs != multi_turn_conversations(tokenizer, 3, 4, 9, 7, 0.5, seed=4)


@pytest.mark.parametrize(
    "kwargs",
    [{"turns": ()}, {"turns": (BenchRequest("p", 1, 1, at_s=1.0),)}, {"think_s": -1.0}, {"at_s": -2.0}],
)
def test_conversation_validates(kwargs):
    with pytest.raises(ValueError):
        Conversation(**({"turns": (BenchRequest("p", 1, 1),)} | kwargs))


def test_bodies_carry_prefix_and_history():
    req = BenchRequest("next?", 9, 4, prefix="SYSTEM ", prefix_len=2)
    history = [("q1", "a1"), ("q2", "a2")]
    chat = request_body("m", "chat", req, history=history)
    assert chat["messages"] == [
        {"role": "system", "content": "SYSTEM "},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "next?"},
    ]  # fmt: skip
    assert request_body("m", "completions", req, history=history)["prompt"] == "SYSTEM q1a1q2a2next?"
    assert request_body("m", "chat", BenchRequest("hi", 1, 1))["messages"] == [{"role": "user", "content": "hi"}]


def _stream(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _send(body: bytes, endpoint: str = "completions") -> RequestRecord:
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await send(http, "http://t", "m", endpoint, BenchRequest("p", 3, 2), None, time.perf_counter())

    return asyncio.run(go())


def test_client_reads_cached_tokens_and_keeps_the_answer():
    usage = '{"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2, ' \
        '"prompt_tokens_details": {"cached_tokens": 32}}}'  # fmt: skip
    rec = _send(_stream('{"choices": [{"text": "he"}]}', '{"choices": [{"text": "llo"}]}', usage, "[DONE]"))
    assert rec.success and rec.cached_tokens == 32 and rec.prompt_len == 40 and rec.generated_text == "hello"
    chat = _stream('{"choices": [{"delta": {"role": "assistant", "content": "a"}}]}',
                   '{"choices": [{"delta": {"content": "b"}}]}',
                   '{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}', "[DONE]")  # fmt: skip
    rec = _send(chat, "chat")
    assert rec.success and rec.cached_tokens is None and rec.generated_text == "ab"  # no details: not reported


def _rec(prompt_len: int, cached: int | None, turn: int | None = None, ttft_s: float = 0.1) -> RequestRecord:
    return RequestRecord("default", prompt_len, 2, 0.0, True, ttft_s=ttft_s, itl_s=[0.01], latency_s=0.2,
                         output_tokens=2, cached_tokens=cached, turn=turn)  # fmt: skip


def test_summary_hit_rate_counts_only_requests_that_reported():
    records = [_rec(100, 80), _rec(50, 0), _rec(1000, None)]
    failed = RequestRecord("default", 400, 2, 0.0, False, error="x", cached_tokens=400)
    s = summarize([*records, failed], 1.0)
    assert s["total_cached_tokens"] == 80 and s["prefix_cache_hit_rate"] == pytest.approx(80 / 150)
    assert s["total_input_tokens"] == 1150
    none = summarize([_rec(100, None)], 1.0)
    assert none["total_cached_tokens"] == 0 and none["prefix_cache_hit_rate"] is None
    table = format_table(none, (50, 99))
    assert _rows(table)["Prefix cache hit rate (%):"] == "n/a" and "Per turn" not in table
    assert _rows(format_table(s, (50, 99)))["Prefix cache hit rate (%):"] == "53.33"


def _rows(table: str) -> dict[str, str]:
    return {line[:40].strip(): line[41:] for line in table.splitlines()}


def test_summary_per_turn():
    records = [_rec(10, 0, 1, 0.5), _rec(30, 20, 2, 0.1), _rec(12, 0, 1, 0.7), _rec(34, 24, 2, 0.2),
               RequestRecord("default", 9, 2, 0.0, False, error="not sent", turn=3)]  # fmt: skip
    s = summarize(records, 2.0, percentiles=(50, 99))
    turns = s["per_turn"]
    assert list(turns) == ["1", "2", "3"]
    assert turns["1"]["median_ttft_ms"] == pytest.approx(600) and turns["2"]["median_ttft_ms"] == pytest.approx(150)
    assert turns["2"]["prefix_cache_hit_rate"] == pytest.approx(44 / 64) and turns["1"]["prefix_cache_hit_rate"] == 0
    assert (turns["3"]["completed"], turns["3"]["failed"]) == (0, 1)
    lines = format_table(s, (50, 99)).splitlines()
    row2 = next(line for line in lines if line.startswith("2 "))
    assert row2.split() == ["2", "2", "0", "32", "68.8", "150.00", "199.00"]
    assert "per_turn" not in summarize([_rec(10, 0)], 1.0)
