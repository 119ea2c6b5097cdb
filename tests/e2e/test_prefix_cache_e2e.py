"""The prefix cache through a real stack, as a client sees it: a repeated prompt answers with the same tokens and
says in `usage.prompt_tokens_details.cached_tokens` how much of it came from the cache; two tenants (two API
keys) sending the same prompt never hit each other's blocks, nor do two `cache_salt`s; `--no-prefix-caching`
reports nothing cached. One mixed worker (its engine prefills and decodes) and, for the hand-off, one prefill +
one decode worker."""

from __future__ import annotations

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.e2e_support import start_stack

PROMPT = "The rules of the house are long and they are repeated on every request that comes in here. " * 5
BLOCK = 16  # the engine's default block size
MAX_TOKENS = 6


def _complete(url: str, key: str | None = None, **extra: str) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a greedy completion of PROMPT."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    usage = out["usage"]
    return out["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("topology", ["mixed", "disaggregated"])
def test_a_repeated_prompt_is_served_from_the_cache_but_never_across_tenants_or_salts(model_dir, topology):
    counts = {"mixed": 1, "prefill": 0, "decode": 0} if topology == "mixed" else {"prefill": 1, "decode": 1}
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, **counts,
                     env={"PDSERVE_API_KEYS": "key-a,key-b"})  # fmt: skip
    stack = start_stack(spec)
    try:
        text, prompt_tokens, cached = _complete(stack.url, "key-a")
        assert cached == 0
        full_blocks = (prompt_tokens - 1) // BLOCK * BLOCK  # the last token is always computed
        assert _complete(stack.url, "key-a") == (text, prompt_tokens, full_blocks)  # same tokens, from the cache
        assert _complete(stack.url, "key-b") == (text, prompt_tokens, 0)  # another tenant: computed anew
        assert _complete(stack.url, "key-a", cache_salt="conversation-1") == (text, prompt_tokens, 0)
        assert _complete(stack.url, "key-a", cache_salt="conversation-1")[2] == full_blocks
    finally:
        stack.stop()


def test_with_prefix_caching_off_nothing_is_cached(model_dir):
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=0, decode=0, mixed=1, threads_per_worker=1,
                     worker_args=("--no-prefix-caching",))  # fmt: skip
    stack = start_stack(spec)
    try:
        first, second = _complete(stack.url), _complete(stack.url)
        assert first == second and first[2] == 0
    finally:
        stack.stop()
