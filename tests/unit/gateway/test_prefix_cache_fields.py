"""The gateway's side of the prefix cache: `cache_salt` and the API key's tenant go into the job's salt (so two
tenants' prompts hash apart: shared/prefix_hash.py), `prompt_cache_key` reaches the job, and the worker's count of
cached prompt tokens comes back as OpenAI's `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

from litestar.testing import TestClient

from services.gateway import create_app
from services.gateway.ordering import TokenOrder
from shared.messages import FinishedEvent, FinishReason, TokensEvent
from shared.prefix_hash import block_hashes, root_hash
from tests.unit.gateway.harness import settings_for

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_cached_tokens_reach_the_usage_whole_and_streamed(client, fake):
    fake.cached_tokens = 16
    body = client.post("/v1/chat/completions", json=CHAT).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    streamed = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert '"cached_tokens":16' in lines[-1]


def test_the_first_event_of_the_computing_worker_sets_the_count_once():
    order = TokenOrder()
    [first] = order.push(TokensEvent("r", 0, seq=0, token_ids=[5], cached_tokens=32))
    [last] = order.push(FinishedEvent("r", 0, seq=1, token_ids=[6], finish_reason=FinishReason.STOP))
    assert (first.cached_tokens, last.cached_tokens) == (32, 0)


def test_cache_salt_and_prompt_cache_key_reach_the_job(client, fake):
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "s1", "prompt_cache_key": "conv-7"})
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": "s2"})
    plain, salted, completion = fake.jobs
    assert (plain.cache_salt, plain.cache_key) == ("", None)
    assert salted.cache_salt and salted.cache_key == "conv-7"
    assert completion.cache_salt and completion.cache_salt != salted.cache_salt


def test_an_empty_or_overlong_salt_is_refused_naming_it(client, fake):
    for salt in ("", "x" * 257):
        response = client.post("/v1/chat/completions", json={**CHAT, "cache_salt": salt})
        assert response.status_code == 400 and "cache_salt" in response.text
    assert fake.jobs == []


def test_two_tenants_never_share_a_salt_and_so_no_block(checkpoint, fake):
    """Each API key is a tenant: the same prompt (and the same cache_salt) gets other block hashes per key, so
    one tenant's cached prefix can never serve, or be timed by, another."""
    with TestClient(create_app(settings_for(checkpoint, api_keys=("key-a", "key-b")), fake)) as client:
        for key in ("key-a", "key-b", "key-a"):
            headers = {"Authorization": f"Bearer {key}"}
            assert client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "same"}, headers=headers).is_success
    a, b, a_again = fake.jobs
    assert a.cache_salt == a_again.cache_salt != b.cache_salt
    assert "key-a" not in a.cache_salt and "key-b" not in b.cache_salt  # a digest travels, never the key
    hashes = [set(block_hashes(j.prompt_token_ids * 8, 4, root_hash("demo", j.cache_salt))) for j in (a, b)]
    assert hashes[0] and not hashes[0] & hashes[1]
